"""Finished jobs leave the jobs table for the partitioned history, and nothing is lost there.

The archive moves a finished row once it holds no key: a job enqueued without a job_id at
once, a keyed one only after its idempotency window. Retention drops whole history
partitions. Replay, ``get_result`` and the failure monitor read across the boundary.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test import override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.control.failures import fetch_page
from jobs.control.tables import Filters, RunTable, run_tables
from jobs.models import Job, JobHistory
from jobs.queue import history
from jobs.queue.history import DAY, HOUR, Partition, plan
from jobs.scheduler.clock import database_now
from jobs.scheduler.retention import Archive, Retention
from tests.support.history import finish, job, where

pytestmark = pytest.mark.django_db

SECOND = timedelta(seconds=1)


def test_a_keyless_job_moves_whole_to_history_once_finished():
    (pk,) = finish(job(), result={"answer": 42})
    before = Job.objects.values().get(pk=pk)
    assert before["key_held"] is False  # a generated job_id is let go at the finish

    moved = history.archive(now=database_now() + timedelta(minutes=1))

    assert moved == {"succeeded": (1, 1)}
    assert where(pk) == "history"
    row = JobHistory.objects.values().get(pk=pk)
    for column in ("job_id", "name", "payload", "tenant", "queue", "attempts", "result"):
        assert row[column] == before[column], column
    assert row["finished_at"] == before["finished_at"]
    assert row["keyed"] is False


def test_nothing_moves_before_archive_after():
    (pk,) = finish(job())
    with override_settings(JOBS={"ARCHIVE_AFTER": 3600}):
        assert history.archive(now=database_now() + timedelta(minutes=1)) == {}
    assert where(pk) == "jobs"


def test_a_keyed_job_keeps_its_window_in_the_jobs_table_across_archive_and_retention():
    (pk,) = finish(job("order-7"))
    now = database_now()
    inside = now + timedelta(hours=23)  # SUCCESS_WINDOW is 24 hours

    Archive().run_once(inside)
    Retention().run_once(inside)

    assert where(pk) == "jobs"
    again = queue.enqueue(job("order-7"))
    assert (again.id, again.created) == (pk, False)  # the window still holds: no rerun

    with override_settings(JOBS={"SUCCEEDED_RETENTION": timedelta(days=3)}):
        past = now + timedelta(hours=25)
        Archive().run_once(past)
        Retention().run_once(past)
        assert where(pk) == "history"
    fresh = queue.enqueue(job("order-7"))
    assert fresh.created and fresh.id != pk


def test_a_failed_keyed_job_moves_after_the_failure_window():
    (pk,) = finish(job("report-1"), state="failed")
    now = database_now()
    assert history.archive(now=now + 30 * SECOND) == {}  # FAILURE_WINDOW is one minute
    assert history.archive(now=now + 2 * timedelta(minutes=1)) == {"failed": (1, 1)}
    assert where(pk) == "history"


def test_rows_already_past_retention_are_deleted_not_moved():
    (pk,) = finish(job())
    moved = history.archive(now=database_now() + timedelta(days=2))  # retention: 24 hours
    assert moved == {"succeeded": (1, 0)}
    assert where(pk) == "gone"


def test_retention_drops_whole_partitions_once_their_last_hour_is_past():
    (old,) = finish(job())
    now = database_now()
    history.archive(now=now + timedelta(minutes=1))
    (part,) = [p for p in _partitions("succeeded") if p.start <= now < p.end]
    assert part.end - part.start == HOUR  # succeeded rows: retention 24 h, hourly partitions

    with connection.cursor() as cur:  # the count of a drop is PostgreSQL's estimate
        cur.execute(f"ANALYZE {part.name}")
    kept = history.drop_expired(now=part.end + timedelta(hours=24) - SECOND)
    assert kept == {} and where(old) == "history"

    dropped = history.drop_expired(now=part.end + timedelta(hours=24))
    assert dropped == {"succeeded": 1}
    assert where(old) == "gone"
    assert part not in _partitions("succeeded")


def test_long_retentions_get_daily_partitions_and_widths_never_overlap():
    finish(job(), state="failed")
    now = database_now()
    history.archive(now=now + timedelta(minutes=2))
    (daily,) = [p for p in _partitions("failed") if p.start <= now < p.end]
    assert daily.end - daily.start == DAY  # FAILED_RETENTION is 14 days
    # Partitions outlive the tests that made them: one beside this day (an earlier test's,
    # say, made for the next day when the suite runs late in the evening) is dropped, so the
    # hours on both sides are uncovered. Rows never outlive a test, so it is empty.
    hour_before = (daily.start - HOUR, daily.start)
    hour_after = (daily.end, daily.end + HOUR)
    with connection.cursor() as cur:
        for p in _partitions("failed"):
            if any(p.start < end and p.end > start for start, end in (hour_before, hour_after)):
                cur.execute(f"DROP TABLE {p.name}")

    # Retention shortened: new partitions are hourly, cut to fit beside the daily one.
    shorter = override_settings(JOBS={"FAILED_RETENTION": timedelta(days=1)})
    with shorter, connection.cursor() as cur:
        created = history.ensure(cur, "failed", daily.start - HOUR, daily.end + HOUR / 2)
    assert [(p.start, p.end) for p in created] == [
        (daily.start - HOUR, daily.start),
        (daily.end, daily.end + HOUR),
    ]


def test_replay_brings_a_failed_job_back_from_history_under_its_id():
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + timedelta(minutes=1))
    assert where(pk) == "history"

    report = queue.replay([pk], by="alice")

    assert report.replayed == (pk,)
    assert where(pk) == "jobs"
    row = Job.objects.get(pk=pk)
    assert (row.state, row.attempts, row.replayed_by, row.key_held) == ("queued", 0, "alice", True)
    assert queue.replay([pk], by="bob").replayed == ()  # a second replay acts on nothing


def test_the_history_table_replays_through_the_monitor_contract():
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + timedelta(minutes=1))
    table = next(t for t in run_tables() if t.model is JobHistory)
    assert table.supports_replay and table.replay_permission == "jobs.replay_job"
    assert table.eligible_pks([pk]) == [pk]

    page = fetch_page([table], Filters(state="failed"))
    assert [row.pk for row in page.rows] == [pk]

    assert table.replay([pk], by="carol") == 1
    assert where(pk) == "jobs"


def test_a_replay_whose_key_was_taken_leaves_the_newer_job_alone():
    (pk,) = finish(job("import-9"), state="failed")
    history.archive(now=database_now() + timedelta(minutes=2))
    newer = queue.enqueue(job("import-9"))
    assert newer.created

    report = queue.replay([pk], by="dave")

    assert report.key_taken == (pk,)
    assert Job.objects.get(pk=newer.id).state == "queued"


def test_a_user_who_may_view_jobs_may_view_their_history(django_user_model):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    user = django_user_model.objects.get(pk=user.pk)  # fresh permission cache
    assert RunTable(JobHistory).can_view(user)


@pytest.mark.django_db(transaction=True)
def test_two_archive_passes_at_once_move_each_row_once(threads):
    ids = finish(*[job() for _ in range(300)])
    later = database_now() + timedelta(minutes=1)
    with connection.cursor() as cur:  # one leader creates partitions; here, before the race
        history.ensure(cur, "succeeded", later - timedelta(hours=1), later)

    results = threads(2, lambda _i: history.archive(batch_size=50, now=later))

    moved = sum(r.get("succeeded", (0, 0))[0] for r in results)
    assert moved == 300
    assert JobHistory.objects.filter(pk__in=ids).count() == 300
    assert not Job.objects.filter(pk__in=ids).exists()


@given(
    spans=st.lists(
        st.tuples(st.integers(0, 24 * 20), st.integers(0, 24 * 3), st.sampled_from([HOUR, DAY])),
        min_size=1,
        max_size=6,
    )
)
@settings(max_examples=200, deadline=None)
def test_planned_partitions_never_overlap_and_cover_every_hour_asked_for(spans):
    base = datetime(2026, 1, 1, tzinfo=UTC)
    existing: list[Partition] = []
    for offset, length, span in spans:
        first = base + timedelta(hours=offset, minutes=17)
        last = first + timedelta(hours=length)
        existing += plan(existing, "failed", first, last, span)
        hour = first.replace(minute=0)
        while hour <= last:
            assert sum(p.start <= hour < p.end for p in existing) == 1
            hour += HOUR
    ordered = sorted(existing, key=lambda p: p.start)
    for a, b in itertools.pairwise(ordered):
        assert a.end <= b.start
    for p in existing:
        assert p.start < p.end and Partition.parse(p.name) == p


def _partitions(state: str) -> list[Partition]:
    with connection.cursor() as cur:
        return history.partitions(cur, state)


KEPT_AND_QUEUED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
                      replayed_by, created_at, finished_at)
SELECT 'row-' || g, 'test.noop.v1', '{}', 'default', 'default', 0, 5, now(),
       CASE WHEN g %% 2 = 0 THEN 'queued' ELSE 'succeeded' END, g %% 2, '', '', '', TRUE, TRUE,
       '', now(), CASE WHEN g %% 2 = 0 THEN NULL ELSE now() END
FROM generate_series(1, %(count)s) AS g
"""


@pytest.mark.django_db(transaction=True)
def test_the_archive_pass_reads_only_what_it_moves():
    """Queued rows and finished rows inside their window are never read by the pass."""
    with connection.cursor() as cur:
        # Earlier tests' rolled-back rows leave dead entries in the index the pass walks;
        # how many depends on what ran before, not on the pass. Start from a vacuumed table.
        cur.execute("VACUUM jobs_job")
        cur.execute(KEPT_AND_QUEUED, {"count": 100000})
        cur.execute("ANALYZE jobs_job")
        cur.execute("SELECT statement_timestamp()")
        (now,) = cur.fetchone()
        plans = []
        for held, until in ((False, now + timedelta(minutes=1)), (True, now - timedelta(days=1))):
            params = {
                "state": "succeeded",
                "held": held,
                "until": until,
                "expired_before": now - timedelta(hours=24),
                "batch": 5000,
            }
            cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + history._ARCHIVE, params)
            plans.append(cur.fetchone()[0])
        cur.execute("SELECT pg_relation_size('jobs_job') / current_setting('block_size')::int")
        (table_pages,) = cur.fetchone()

    text = str(plans)
    # The jobs table is never scanned whole. (A small side table, such as the empty
    # dependency table, may be: the planner's choice depends on what its statistics say
    # after earlier tests, not on the pass.)
    scanned = [node for plan in plans for node in plan_nodes(plan[0]["Plan"])]
    assert not [
        n for n in scanned if n["Node Type"] == "Seq Scan" and n["Relation Name"] == "jobs_job"
    ], text
    assert "jobs_job_terminal" in text, text
    touched = sum(
        p[0]["Plan"]["Shared Hit Blocks"] + p[0]["Plan"]["Shared Read Blocks"] for p in plans
    )
    # 50,000 rows inside their window: about 170 pages of the index, 1,000 of the table. The
    # pass reads a few index pages (and dead entries other tests' rolled-back rows left).
    assert table_pages > 1000
    assert touched < 100, (touched, text)


def plan_nodes(node: dict):
    """Every node of an EXPLAIN (FORMAT JSON) plan tree."""
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)
