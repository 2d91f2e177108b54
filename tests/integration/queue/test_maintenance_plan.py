"""The worker's exhaustion pass reads only rows that can be exhausted, never the fresh backlog.

A queued job can run out of attempts only once it has run (a retry) or when its own limit is
below its attempts; the pass finds those through small partial indexes, so its cost does not
grow with the number of fresh queued jobs (attempts = 0).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, AllTenantsExcept, OnlyTenant
from jobs.queue.maintenance import fail_exhausted_sql
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

FRESH = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT 'fresh-' || g, 'test.noop.v1', '{}', 'default', 'default', 0, 5, now(), 'queued', 0,
       '', '', '', TRUE, '', now()
FROM generate_series(1, %(count)s) AS g
"""


def explain(scope, caps: dict[str, int]) -> str:
    sql, params = fail_exhausted_sql(scope=scope, max_attempts=caps, limit=100)
    with connection.cursor() as cur:
        cur.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cur.fetchall())


@pytest.mark.parametrize(
    "scope", [AllTenants(), AllTenantsExcept("worker"), OnlyTenant("default")], ids=repr
)
def test_the_exhaustion_pass_never_reads_the_fresh_backlog(scope):
    with connection.cursor() as cur:
        cur.execute(FRESH, {"count": 20000})
        cur.execute("ANALYZE jobs_job")

    plan = explain(scope, {"test.noop.v1": 3, "other.v1": 2})

    assert "Seq Scan on jobs_job" not in plan, plan
    assert "jobs_job_retrying" in plan, plan
    assert "jobs_job_out_of_attempts" in plan, plan
    assert "jobs_job_claim" not in plan, plan  # the claim index holds the whole backlog


def test_jobs_over_their_own_limit_are_found_through_their_partial_index():
    """PostgreSQL guesses that a third of the rows have attempts >= max_attempts, so reading
    the first few of them from a table grown by rows gone since can look cheaper than the
    partial index that holds only those (as a run of the suite once found): however grown the
    table, the pass reads the index."""
    with connection.cursor() as cur:
        cur.execute("SAVEPOINT gone")
        cur.execute(FRESH, {"count": 200_000})
        cur.execute("ROLLBACK TO SAVEPOINT gone")  # their pages stay until a vacuum
        cur.execute(FRESH, {"count": 20000})
        cur.execute("ANALYZE jobs_job")
        sql, params = fail_exhausted_sql(
            scope=AllTenantsExcept("worker"), max_attempts={}, limit=100
        )
        cur.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        plan = cur.fetchone()[0]
    [branch] = [node for node in plan_nodes(plan[0]["Plan"]) if node.get("Alias") == "*SELECT* 2"]
    scans = {
        (node["Node Type"], node.get("Index Name"))
        for node in plan_nodes(branch)
        if node.get("Relation Name") == "jobs_job"
    }
    assert {index for _kind, index in scans} == {"jobs_job_out_of_attempts"}, scans


def plan_nodes(node: dict) -> list[dict]:
    """A plan node and every node under it."""
    return [node] + [found for child in node.get("Plans", []) for found in plan_nodes(child)]


def test_the_pass_still_fails_what_it_should_and_nothing_else():
    """Lowered limits, a job over its own limit, a lease lost on the last attempt."""
    now = timezone.now()
    lowered = JobFactory(name="test.noop.v1", attempts=3, max_attempts=10)
    below = JobFactory(name="test.noop.v1", attempts=2, max_attempts=10)
    over_own = JobFactory(name="other.v1", attempts=5, max_attempts=5)
    fresh = JobFactory(name="test.noop.v1", attempts=0, max_attempts=10)
    lost = JobFactory(
        name="other.v1",
        running=True,
        attempts=3,
        max_attempts=3,
        lease_expires_at=now - timedelta(seconds=1),
    )

    failed = queue.fail_exhausted(max_attempts={"test.noop.v1": 3})

    assert sorted(row.id for row in failed) == sorted([lowered.id, over_own.id, lost.id])
    codes = {row.id: row.code for row in failed}
    assert codes[lost.id] == "lease_expired"
    assert codes[lowered.id] == codes[over_own.id] == "attempts_exhausted"
    untouched = dict(Job.objects.filter(pk__in=[below.id, fresh.id]).values_list("pk", "state"))
    assert untouched == {below.id: "queued", fresh.id: "queued"}


FINISHED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at, finished_at)
SELECT 'done-' || g, 'test.noop.v1', '{}', 'default', 'default', 0, 5, now(), 'succeeded', 1,
       '', '', '', g %% 2 = 0, '', now(), now() - (g %% 1000) * interval '1 minute'
FROM generate_series(1, %(count)s) AS g
"""


def statements_of(call) -> list[tuple[str, object]]:
    """The SQL statements (and parameters) ``call()`` runs."""
    seen: list[tuple[str, object]] = []

    def capture(execute, sql, params, many, context):
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        call()
    return seen


def plan_of(sql: str, params) -> str:
    with connection.cursor() as cur:
        cur.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cur.fetchall())


def test_lease_recovery_and_retention_read_their_own_small_indexes():
    """requeue_expired reads running rows only; prune one ordered range of terminal rows."""
    with connection.cursor() as cur:
        cur.execute(FRESH, {"count": 20000})
        cur.execute(FINISHED, {"count": 20000})
        cur.execute("ANALYZE jobs_job")

    [(requeue, params)] = statements_of(lambda: queue.requeue_expired(scope=AllTenants()))
    plan = plan_of(requeue, params)
    assert "Seq Scan on jobs_job" not in plan and "jobs_job_running" in plan, plan

    prunes = [
        (sql, p)
        for sql, p in statements_of(lambda: queue.prune(batch_size=100, max_batches=1))
        if "DELETE" in sql
    ]
    assert prunes
    for sql, p in prunes:
        plan = plan_of(sql, p)
        assert "Seq Scan on jobs_job" not in plan and "jobs_job_terminal" in plan, plan
