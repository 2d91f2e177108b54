"""The backlog count is bounded: exact up to a cap, estimated above it, never a backlog scan.

``jobs.queue.backlog`` finds the queued names (and their priorities) by skipping through the
claim index, then counts at most ``cap + 1`` index entries per name for "queued" and as many
for "due". Its cost therefore depends on the number of names and the cap, not on how many
rows are queued; the plan test proves it on 200,000 queued rows.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import queue
from jobs.queue import BACKLOG_CAP, BacklogRow
from jobs.queue._db import load_json
from jobs.queue.maintenance import backlog_sql
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

QUEUED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT %(name)s || '-' || g, %(name)s, '{}', 't' || (g %% 3), 'default', (g %% 3) - 1, 5,
       CASE WHEN g <= %(due)s THEN now() - interval '1 minute' ELSE now() + interval '1 day' END,
       'queued', 0, '', '', '', TRUE, '', now()
FROM generate_series(1, %(count)s) AS g
"""


def fill(name: str, count: int, *, due: int | None = None) -> None:
    """``count`` queued jobs of ``name`` over three tenants and priorities; ``due`` are due."""
    with connection.cursor() as cur:
        cur.execute(QUEUED, {"name": name, "count": count, "due": count if due is None else due})


def analyze() -> None:
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_job")


def by_name(rows: list[BacklogRow]) -> dict[str, BacklogRow]:
    return {row.name: row for row in rows}


def test_counts_are_exact_up_to_the_cap_over_every_tenant_and_priority():
    later = timezone.now() + timedelta(hours=1)
    JobFactory.create_batch(2, name="a.v1", tenant="acme")
    JobFactory(name="a.v1", tenant="globex", priority=5, run_after=later)
    JobFactory(name="a.v1", tenant="acme", priority=-3)
    JobFactory(name="b.v1", tenant="globex")
    JobFactory(name="a.v1", running=True)  # not queued
    JobFactory(name="c.v1", succeeded=True)  # not queued

    rows = queue.backlog(supported={"a.v1"}, cap=4)

    assert [(r.name, r.supported, r.queued, r.due, r.queued_exact, r.due_exact) for r in rows] == [
        ("a.v1", True, 4, 3, True, True),
        ("b.v1", False, 1, 1, True, True),
    ]


def test_the_oldest_due_job_of_each_name_and_none_when_nothing_is_due():
    now = timezone.now()
    JobFactory(name="a.v1", priority=9, run_after=now - timedelta(minutes=1))
    JobFactory(name="a.v1", priority=-9, run_after=now - timedelta(minutes=5))
    JobFactory(name="later.v1", run_after=now + timedelta(hours=1))

    rows = by_name(queue.backlog())

    assert rows["a.v1"].oldest_due is not None
    assert abs(rows["a.v1"].oldest_due - (now - timedelta(minutes=5))) < timedelta(seconds=1)
    assert (rows["later.v1"].due, rows["later.v1"].oldest_due) == (0, None)


def test_above_the_cap_queued_is_an_estimate_and_due_a_floor():
    fill("big.v1", 3000)  # all due
    fill("late.v1", 3000, due=50)  # mostly scheduled for tomorrow
    fill("small.v1", 80)
    analyze()

    rows = by_name(queue.backlog(cap=100))

    big, late, small = rows["big.v1"], rows["late.v1"], rows["small.v1"]
    assert not big.queued_exact and 2000 <= big.queued <= 4500, big  # the planner's estimate
    assert (big.due, big.due_exact) == (101, False)  # "more than 100"
    assert not late.queued_exact and late.queued > 100
    assert (late.due, late.due_exact) == (50, True)  # few due: still exact
    assert (small.queued, small.due, small.queued_exact, small.due_exact) == (80, 80, True, True)


def test_an_estimate_is_never_below_the_cap():
    """Counted past the cap, but ANALYZE last saw an almost empty table: at least cap + 1."""
    analyze()
    fill("fresh.v1", 500)

    [row] = queue.backlog(cap=100)

    assert not row.queued_exact and row.queued >= 101


def test_the_default_cap_is_a_thousand():
    assert BACKLOG_CAP == 1_000


def scans(plan: dict) -> list[dict]:
    """Every node of a JSON plan that reads a relation."""
    found = [plan] if "Relation Name" in plan else []
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


def test_the_count_never_reads_the_whole_backlog():
    """200,000 queued rows: the statement reads at most about cap + 1 entries per name and
    count, each through the claim index, and no heap scan."""
    fill("a.v1", 150_000)
    fill("b.v1", 45_000, due=30_000)
    fill("c.v1", 5_000)
    analyze()
    sql, params = backlog_sql(cap=BACKLOG_CAP)

    with connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        [plan] = load_json(cur.fetchone()[0])

    nodes = scans(plan["Plan"])
    assert {n["Node Type"] for n in nodes} <= {"Index Only Scan", "Index Scan"}, nodes
    assert {n["Index Name"] for n in nodes} == {"jobs_job_claim"}
    read = sum(n["Actual Rows"] * n["Actual Loops"] for n in nodes)
    # a.v1 and b.v1: cap + 1 for queued and for due each; c.v1: all 5,000 twice; plus the
    # skip scan's one entry per (name, priority) level and the oldest entry of each level.
    assert read <= 4 * (BACKLOG_CAP + 1) + 2 * 5_000 + 100, read
    assert read < 200_000 / 3
