"""Finished jobs leave the jobs table for the partitioned history, and nothing is lost there.

The archive moves a finished row once it holds no key: a job enqueued without a job_id at once,
a keyed one only after its idempotency window. Retention drops whole history partitions. Neither
waits long behind a reader of the history, nor fails when two passes overlap or ``USE_TZ`` is
off; a row is in exactly one table at every moment. The failure monitor reads across the
boundary (replay from the history: control/test_replays.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.control.tables import RunTable
from jobs.core.conf import jobs_settings
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory, ScheduleSlot
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome, batches, history
from jobs.queue.history import DAY, HOUR, Partition, plan
from jobs.queue.history_partitions import floor as _floor
from jobs.runs import TERMINAL_STATES
from jobs.scheduler.retention import Archive, Retention
from tests.support.concurrency import Background, Producer
from tests.support.history import (
    MINUTE,
    NAME,
    HistoryWriter,
    finish,
    insert_if_ready,
    insert_row,
    job,
    ready_history,
    ready_until,
    where,
)

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
    # Nothing with a row in it goes (empty partitions earlier tests left behind may).
    assert not any(kept.values()) and where(old) == "history"
    assert part in _partitions("succeeded")

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


@contextmanager
def history_reader() -> Iterator[None]:
    """A long read of the history (a report, pg_dump): ACCESS SHARE on every partition."""
    ready, done = threading.Event(), threading.Event()

    def body() -> None:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM jobs_jobhistory")
            ready.set()
            done.wait(120)

    reader = Background(body)
    try:
        assert ready.wait(30), "the reader did not start"
        yield
    finally:
        done.set()
        reader.result()


@contextmanager
def lock_timeout(value: str) -> Iterator[None]:
    """The scheduler's DB_LOCK_TIMEOUT bound on this test's own connection."""
    with connection.cursor() as cur:
        cur.execute(f"SET lock_timeout = '{value}'")
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")


def drop_partitions_covering(state: str, moment) -> None:
    """Make sure no partition of ``state`` covers ``moment`` (partitions outlive flushes)."""
    with connection.cursor() as cur:
        for part in history.partitions(cur, state):
            if part.start <= moment < part.end:
                cur.execute(f"DROP TABLE {part.name}")


def finished_at(pk: int, moment) -> None:
    Job.objects.filter(pk=pk).update(finished_at=moment)


@pytest.mark.django_db(transaction=True)
def test_a_long_reader_of_the_history_does_not_stop_the_archive():
    """An open read of the history does not stop the archive.

    ``CREATE TABLE … PARTITION OF jobs_jobhistory_<state>`` needs ACCESS EXCLUSIVE on the
    state's partition, which conflicts with any open read of the history (a report, the admin's
    count, a nightly pg_dump holds ACCESS SHARE for hours). Succeeded rows need a new partition
    every hour. Partitions are made as CREATE TABLE + ATTACH PARTITION (SHARE UPDATE EXCLUSIVE,
    no conflict with readers), so under the scheduler's DB_LOCK_TIMEOUT the pass neither fails
    before it reaches the failed and cancelled states, leaving nothing archived while the
    reader runs, nor (without a lock timeout) queues every later reader behind it.
    """
    (failed_pk,) = finish(job(), state="failed")
    (succeeded_pk,) = finish(job())
    now = database_now()
    hour_ago = now - 7 * HOUR
    finished_at(succeeded_pk, hour_ago)  # an hour whose partition does not exist yet
    drop_partitions_covering("succeeded", hour_ago)
    with connection.cursor() as cur:  # the failed rows' daily partition exists already
        history.ensure(cur, "failed", now - timedelta(days=1), now + timedelta(days=1))

    error = None
    with history_reader(), lock_timeout("1s"):
        try:
            history.archive(now=now + MINUTE)
        except OperationalError as exc:
            error = exc

    assert error is None, f"the archive pass failed behind a reader: {error}"
    assert where(failed_pk) == "history"
    assert where(succeeded_pk) == "history"


@pytest.mark.django_db(transaction=True)
def test_retention_goes_on_when_a_partition_drop_waits_behind_a_reader():
    """One partition that cannot be dropped does not fail the whole duty.

    The DROP waits behind any reader of the history; a lock timeout on one partition is left
    for the next pass, and ``Retention.run_once`` goes on to prune the cron slots (called after
    it) and logs what it did delete, also while a long reader (pg_dump) runs.
    """
    now = database_now()
    old = now - timedelta(days=30)  # CANCELLED_RETENTION is 7 days: wholly expired
    with connection.cursor() as cur:
        history.ensure(cur, "cancelled", old, old)
    for days in (60, 59):
        ScheduleSlot.objects.create(
            schedule="history-retention",
            slot=now - timedelta(days=days),
            kind="on_time",
            job_id=f"cron:history-retention:{days}",
        )

    error = None
    with history_reader(), lock_timeout("1s"):
        try:
            Retention().run_once()
        except OperationalError as exc:
            error = exc

    assert error is None, f"retention failed behind a reader: {error}"
    assert ScheduleSlot.objects.filter(schedule="history-retention").count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_archive_passes_needing_the_same_new_partition_both_succeed():
    """Two archive passes that need the same new partition both succeed.

    Both find the partition missing before either takes the parent's lock; without a lock the
    second would create it again and fail with "relation already exists". Two passes overlap
    when leadership moves while the old leader is mid-pass, or when someone calls
    ``history.archive()`` by hand. (The other concurrency test creates the partitions before
    the race, so it does not cover this.)
    """
    (pk,) = finish(job())
    now = database_now()
    moment = now - 9 * HOUR
    finished_at(pk, moment)
    drop_partitions_covering("succeeded", moment)

    # Partitions are attached under an advisory lock, so the passes take turns (and a
    # reader of the history holds neither up). Both start together behind a reader.
    with history_reader():
        passes = [Background(lambda: history.archive(now=now + MINUTE)) for _ in range(2)]

    results = []
    errors = []
    for p in passes:
        try:
            results.append(p.result())
        except Exception as exc:  # the finding itself
            errors.append(exc)
    assert not errors, errors
    assert where(pk) == "history"


@pytest.mark.django_db
def test_archive_and_retention_work_with_use_tz_false():
    """With ``USE_TZ = False`` the archive and retention duties run.

    Django then returns naive datetimes, while ``plan()`` and ``drop_expired`` compare them
    with aware partition hours and bounds; neither duty raises TypeError on a pass (which would
    stop retention before it prunes cron slots, and archive nothing ever).
    """
    finish(job())
    with connection.cursor() as cur:  # a partition for retention to look at
        history.ensure(cur, "cancelled", database_now(), database_now())
    with override_settings(USE_TZ=False):
        now = database_now()
        assert now.tzinfo is None  # naive, as Django promises with USE_TZ = False
        errors = {}
        for duty in (Archive(), Retention()):
            try:
                duty.run_once(now + MINUTE)
            except TypeError as exc:
                errors[type(duty).__name__] = str(exc)
    assert not errors, errors


@pytest.mark.django_db
def test_an_archive_pass_makes_at_most_max_batches_statements_per_state():
    """ "At most 20 statements of 5,000 rows per state", as docs/queue.md says.

    The pass shares one batch count per state between rows that let go of their key and key
    holders whose window passed, so a state moves no more than the ArchiveConfig comment
    ("statements per state and pass") promises, not twice that.
    """
    for _ in range(2):
        finish(job(), state="failed")  # keyless: let go at the finish
    for key in ("doc-a", "doc-b"):
        finish(job(key), state="failed")  # keyed: hold through FAILURE_WINDOW (1 minute)

    moved = history.archive(batch_size=1, max_batches=1, now=database_now() + 2 * MINUTE)

    assert moved["failed"][0] <= 1, moved


@pytest.mark.django_db(transaction=True)
def test_enqueue_racing_the_archive_of_its_expired_key_holder_makes_one_job(threads):
    """Enqueues of a key whose old holder the archive is moving agree on one new row."""
    with override_settings(JOBS={"FAILURE_WINDOW": 0}):
        (old,) = finish(job("race-key"), state="failed")
        later = database_now() + MINUTE
        with connection.cursor() as cur:
            history.ensure(cur, "failed", later - timedelta(days=1), later + timedelta(days=1))

        def body(i: int) -> Any:
            if i == 0:
                return history.archive(batch_size=1, now=later)
            return queue.enqueue(job("race-key")).id

        results = threads(9, body)

    ids = set(results[1:])
    assert len(ids) == 1 and old not in ids, results
    live = Job.objects.filter(job_id="race-key", key_held=True)
    assert [row.pk for row in live] == list(ids)
    assert where(old) in ("history", "jobs")  # moved now or at the next pass, never lost


@pytest.mark.django_db(transaction=True)
def test_a_row_is_always_in_exactly_one_table_while_the_archive_runs(threads):
    """Readers never see a moving row in both tables or in neither (one statement).

    Read at one snapshot (REPEATABLE READ), the row count of jobs plus history is constant
    while the archive moves everything in small batches.
    """
    ids = finish(*[job() for _ in range(200)])
    later = database_now() + MINUTE
    with connection.cursor() as cur:
        history.ensure(cur, "succeeded", later - HOUR, later)
    stop = threading.Event()

    def body(i: int) -> Any:
        if i == 0:
            try:
                while history.archive(batch_size=7, max_batches=1, now=later):
                    pass
            finally:
                stop.set()
            return None
        seen = []
        while not stop.is_set():
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cur.execute(
                    "SELECT (SELECT count(*) FROM jobs_job WHERE id = ANY(%s)) + "
                    "(SELECT count(*) FROM jobs_jobhistory WHERE id = ANY(%s))",
                    [ids, ids],
                )
                seen.append(cur.fetchone()[0])
        return seen

    results = threads(3, body, timeout=120)
    counts = {n for seen in results[1:] for n in seen}
    assert counts == {200}, counts
    assert JobHistory.objects.filter(pk__in=ids).count() == 200


@pytest.mark.django_db
def test_retention_never_drops_a_partition_holding_a_row_inside_its_retention():
    """A kept row survives every drop until its own retention has passed."""
    (pk,) = finish(job(), state="failed")
    now = database_now()
    history.archive(now=now + 2 * MINUTE)
    row = JobHistory.objects.get(pk=pk)
    retention = timedelta(days=14)
    for offset in (timedelta(0), timedelta(days=13), retention - timedelta(seconds=1)):
        history.drop_expired(now=row.finished_at + offset)
        assert where(pk) == "history", offset
    # once the partition's end is past, it goes (a day at most after the row's retention)
    history.drop_expired(now=_floor(row.finished_at, timedelta(days=1)) + timedelta(days=15))
    assert where(pk) == "gone"


# The history made ready ahead of the rows: the worker's pass writes a finished row straight
# into the history only where history.READY_UNTIL says its partition waits for it.

HOURLY, DAILY = timedelta(days=1), timedelta(days=14)  # retentions kept hourly, and daily
#: Far from the times other tests leave partitions at: each example starts from none.
FUTURE = datetime(2040, 1, 1, tzinfo=UTC)


def retained(state: str, kept: timedelta):
    return override_settings(JOBS={f"{state.upper()}_RETENTION": kept})


def schedulers_lock_timeout():
    """The scheduler's own bound on its connection's lock waits (``DB_LOCK_TIMEOUT``)."""
    return lock_timeout(f"{int(jobs_settings.DB_LOCK_TIMEOUT.total_seconds() * 1000)}ms")


def drop_partitions_from(state: str, moment: datetime) -> None:
    with connection.cursor() as cur:
        for part in history.partitions(cur, state):
            if part.end > moment:
                cur.execute(f"DROP TABLE {part.name}")


class Rollback(Exception):
    """Undoes an example's partitions and rows."""


@given(
    state=st.sampled_from(TERMINAL_STATES),
    kept=st.sampled_from([HOURLY, DAILY]),
    minutes=st.integers(0, 60 * 24 * 9),
    others=st.lists(st.tuples(st.integers(-30, 60), st.integers(0, 6)), max_size=3),
    into=st.floats(0, 1, exclude_max=True),
)
@settings(max_examples=30, deadline=None)
def test_after_prepare_ahead_a_row_finished_any_time_before_until_has_its_partition(
    state, kept, minutes, others, into
):
    now = FUTURE + timedelta(minutes=minutes, seconds=minutes % 59)
    try:
        with transaction.atomic(), connection.cursor() as cur:
            # Partitions made earlier under the other width (the retention changed since).
            with retained(state, DAILY if kept == HOURLY else HOURLY):
                for start, hours in others:
                    first = now + timedelta(hours=start)
                    history.ensure(cur, state, first, first + timedelta(hours=hours))
            with retained(state, kept):
                history.prepare_ahead(now=now)
                span = history.width(state)
            until = ready_until(state)
            assert until is not None and until - now >= 2 * span  # two widths ahead
            layout = history.partitions(cur, state)
            assert not any(p.start == until for p in layout)  # the end of the coverage
            # (A product is rounded to the microsecond: kept below until.)
            inside = now + (until - now - timedelta(microseconds=1)) * into
            # From CLOCK_SKEW before now: a pass that read its clock just before an hour began.
            earliest = now - history.CLOCK_SKEW
            for pk, at in enumerate((earliest, now, inside, until - timedelta(microseconds=1))):
                with transaction.atomic():
                    insert_row(cur, state, at, pk)  # no partition: raises here
            raise Rollback
    except Rollback:
        pass


@pytest.mark.django_db(transaction=True)
def test_prepare_ahead_once_ready_reads_one_statement_and_writes_nothing():
    now = database_now()
    history.prepare_ahead(now=now)
    ready = {state: ready_until(state) for state in TERMINAL_STATES}
    assert all(until and until > now for until in ready.values()), ready
    with connection.cursor() as cur:
        cur.execute("SELECT xmin::text FROM jobs_historyready ORDER BY state")
        versions = cur.fetchall()

    with CaptureQueriesContext(connection) as queries:
        history.prepare_ahead(now=now + MINUTE)

    assert len(queries) == 1, [q["sql"] for q in queries]
    with connection.cursor() as cur:
        cur.execute("SELECT xmin::text FROM jobs_historyready ORDER BY state")
        assert cur.fetchall() == versions  # no row written again
    assert {state: ready_until(state) for state in TERMINAL_STATES} == ready


def test_the_pass_writes_into_the_history_only_once_it_is_ready():
    with connection.cursor() as cur:
        cur.execute("DELETE FROM jobs_historyready")
        assert ready_until("succeeded") is None
        assert insert_if_ready(cur, "succeeded") == 0  # the row stays in the jobs table
        history.prepare_ahead()
        assert insert_if_ready(cur, "succeeded") == 1


def test_until_never_points_past_a_dropped_partition():
    now = database_now()
    history.prepare_ahead(now=now)
    # Retention run with a time ahead of the clock drops partitions the clock has not
    # reached: the history is no longer ready from the first of them on.
    later = now + timedelta(days=3)
    history.drop_expired(now=later)
    with connection.cursor() as cur:
        layout = history.partitions(cur, "succeeded")
    until = ready_until("succeeded")
    hour = _floor(now, HOUR)
    while until is not None and hour < until:
        assert any(p.start <= hour < p.end for p in layout), f"{hour} is ready, with no partition"
        hour += HOUR
    with connection.cursor() as cur:
        insert_if_ready(cur, "succeeded")  # written or not, never refused

    history.prepare_ahead(now=now)  # the next pass makes it ready again
    assert ready_until("succeeded") - now >= HOUR


@pytest.mark.parametrize("kept", [timedelta(0), -timedelta(hours=5)])
def test_retention_never_drops_a_partition_at_or_after_now(kept):
    """Not even with a retention of nothing (or less): rows finishing now go there."""
    now = database_now()
    history.prepare_ahead(now=now)
    until = ready_until("succeeded")  # hourly partitions: the next three hours' are there
    with retained("succeeded", kept):
        history.drop_expired(now=now)
    history.drop_expired(retentions={"succeeded": kept}, now=now)

    assert ready_until("succeeded") == until
    with connection.cursor() as cur:
        for pk, at in enumerate((now, until - SECOND)):
            with transaction.atomic():
                insert_row(cur, "succeeded", at, pk)


@pytest.mark.django_db(transaction=True)
def test_writers_of_the_history_never_wait_on_prepare_ahead_and_retention(caplog):
    """A connection writing history rows all along never waits more than a moment.

    Once the worker's pass writes finished rows straight into the history, that happens
    continuously, and any DDL on the history queues behind the writes in flight while every
    new write queues behind the DDL. Here the scheduler's DDL runs over and over: partitions
    made ahead (ATTACH PARTITION), and expired ones dropped (DROP TABLE: ACCESS EXCLUSIVE on
    the state's table).
    """
    now = database_now()
    with HistoryWriter(TERMINAL_STATES, ready_only=True) as writer:
        for hour in range(8):
            with connection.cursor() as cur:  # expired, so that retention drops them
                history.ensure(cur, "succeeded", now - DAY * 3 - HOUR * hour, now - DAY * 3)
                history.ensure(cur, "cancelled", now - DAY * 9, now - DAY * 9)
            with schedulers_lock_timeout():  # a wait this long would raise, failing the test
                history.drop_expired(now=database_now())
                history.prepare_ahead(now=database_now() + HOUR * hour)
            writer.wait_for_statements(5)

    assert writer.errors == []
    assert writer.longest < 0.5, f"a write waited {writer.longest:.2f} s"
    assert writer.written > 0  # the history was ready for the pass
    deferred = {getattr(r, "action", None) for r in caplog.records} & {"drop_deferred"}
    assert deferred or not [p for p in _partitions("succeeded") if p.end <= now - DAY]


@pytest.mark.django_db(transaction=True)
def test_a_long_reader_does_not_make_the_schedulers_ddl_hold_up_writers(caplog):
    """Retention's DROP waits behind a reader of the history, and writers queue behind the
    DROP: it gives up after a moment (and tries again next pass) instead of the scheduler's
    lock timeout, seconds during which no finished row could be written."""
    now = database_now()
    with connection.cursor() as cur:
        history.ensure(cur, "succeeded", now - HOUR, now + HOUR)  # where the writer writes
        history.ensure(cur, "succeeded", now - DAY * 3, now - DAY * 3)  # expired
    expired = [p for p in _partitions("succeeded") if p.end <= now - DAY]
    assert expired

    with (
        HistoryWriter(("succeeded",)) as writer,
        history_reader(),
        schedulers_lock_timeout(),
    ):
        writer.wait_for_statements(3)
        Retention().run_once()
        Archive().run_once()
        writer.wait_for_statements(3)

    assert writer.errors == []
    assert writer.longest < 0.5, f"a write waited {writer.longest:.2f} s"
    assert set(expired) <= set(_partitions("succeeded"))  # left for the next pass
    assert "drop_deferred" in [getattr(r, "action", None) for r in caplog.records]


@pytest.mark.django_db(transaction=True)
def test_prepare_ahead_behind_a_lock_on_the_history_defers_within_a_moment(caplog):
    """A session holding a lock ATTACH PARTITION needs (a manual ANALYZE or CREATE INDEX on
    the history) holds up the preparation only a moment; it is tried again next pass."""
    now = FUTURE + timedelta(days=400)
    drop_partitions_from("failed", now - DAY)  # as a database kept from an earlier run has
    holder = Producer(
        lambda: connection.cursor().execute(
            "LOCK TABLE jobs_jobhistory_failed IN SHARE UPDATE EXCLUSIVE MODE"
        )
    ).start()
    try:
        with schedulers_lock_timeout():
            started = time.monotonic()
            history.prepare_ahead(now=now)
            took = time.monotonic() - started
    finally:
        assert holder.finish() is None
    assert took < jobs_settings.DB_LOCK_TIMEOUT.total_seconds() / 2  # not the scheduler's wait
    assert ready_until("failed") is None
    assert "archive_deferred" in [getattr(r, "action", None) for r in caplog.records]
    history.prepare_ahead(now=now)  # the next pass
    assert ready_until("failed") - now >= DAY


def test_ddl_inside_a_callers_transaction_leaves_its_lock_timeout_as_it_was():
    """The short lock wait is the DDL's own: ``SET LOCAL`` would outlast it to the end of the
    caller's transaction, cutting every later wait of the caller's to a tenth of a second."""
    now = FUTURE + timedelta(days=500)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL lock_timeout = '7s'")
        assert history.ensure(cur, "succeeded", now, now)  # made one
        history.drop_expired(now=now + timedelta(days=2))  # and dropped it
        cur.execute("SHOW lock_timeout")
        assert cur.fetchone()[0] == "7s"


# -- A job that ends leaves the jobs table in the statement that ends it ----------------------

#: Columns a job's row carries into the history whatever the moment it was written.
SAME_ANY_TIME = (
    "state", "attempts", "last_error", "error_detail", "result", "progress", "keyed",
    "batch_id", "replayed_by", "payload", "name", "tenant", "queue", "priority",
    "max_attempts", "attempt_log", "claimed_by",
)  # fmt: skip

ENDINGS = st.sampled_from(["succeeded", "result", "failed", "cancelled", "stopped", "progress"])


def _end(kind: str, *, write) -> int:
    """Enqueue, claim and end one keyless job as ``kind``, the outcome sent through ``write``;
    its id."""
    [enqueued] = queue.enqueue_many([job()])
    [held] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants(), worker="test-worker")
    assert held.id == enqueued.id
    outcome = {
        "succeeded": lambda: Outcome.succeeded(held),
        "result": lambda: Outcome.succeeded(held, {"answer": [4, 2], "text": "é\n"}),
        "failed": lambda: Outcome.failed(held, code="rejected", detail="no such order"),
        "cancelled": lambda: Outcome.cancelled(held),
        # An operator asked the running job to stop; its handler then let go of it.
        "stopped": lambda: Outcome.retry(held, code="handler_error", detail="interrupted"),
        "progress": lambda: dataclasses.replace(
            Outcome.succeeded(held), progress_json='{"done": 3, "total": 4}'
        ),
    }[kind]()
    if kind == "stopped":
        assert queue.cancel_running([held.id], by="alice") == [held.id]
    write(outcome)
    return held.id


WRITES = {
    "record": lambda outcome: queue.record([outcome]),
    "record, uncounted": lambda outcome: queue.record([outcome], count=False),
    "the pass": lambda outcome: queue.record_and_claim(
        [outcome], [ClaimRequest(NAME, 1)], scope=AllTenants(), count=False
    ),
}


def _row(pk: int) -> dict[str, Any]:
    for model in (Job, JobHistory):
        if (row := model.objects.filter(pk=pk).values().first()) is not None:
            return row
    raise AssertionError(f"job {pk} is in neither table")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", sorted(WRITES))
@settings(max_examples=12, deadline=None)
@given(kind=ENDINGS)
def test_a_keyless_job_that_ends_leaves_in_the_statement_that_ends_it(how, kind):
    """Its history row is the row the write would have left in the jobs table."""
    try:
        stays = _end(kind, write=WRITES[how])  # the history is not ready: the row stays
        assert where(stays) == "jobs"
        ready_history()
        leaves = _end(kind, write=WRITES[how])
        assert where(leaves) == "history"
        kept, moved = _row(stays), _row(leaves)
        assert {c: moved[c] for c in SAME_ANY_TIME} == {c: kept[c] for c in SAME_ANY_TIME}
        assert moved["finished_at"] >= kept["finished_at"]
    finally:  # each example starts with nothing
        Job.objects.all().delete()
        JobHistory.objects.all().delete()
        with connection.cursor() as cur:
            cur.execute("DELETE FROM jobs_historyready")


@pytest.mark.django_db(transaction=True)
def test_jobs_that_end_stay_where_others_read_them_until_the_archive():
    """A keyed job (its window), a batch member and a job others wait for (the settle trigger),
    a retry, and any job while the history is not ready for its end, stay in the jobs table."""
    ready_history()
    keyed, member, waited_for, retried = (
        queue.enqueue(job("order-7")).id,
        batches.add(batches.open(None), [job()])[0].id,
        queue.enqueue(job()).id,
        queue.enqueue(job()).id,
    )
    queue.enqueue(NewJob(name="test.history.after.v1", after=(waited_for,)))
    held = queue.claim([ClaimRequest(NAME, 4)], scope=AllTenants(), worker="test-worker")
    assert sorted(h.id for h in held) == sorted([keyed, member, waited_for, retried])
    report = queue.record(
        [
            Outcome.retry(h, code="handler_error", delay=3600)
            if h.id == retried
            else Outcome.succeeded(h)
            for h in held
        ]
    )
    assert len(report.applied) == 4
    assert {pk: where(pk) for pk in (keyed, member, waited_for, retried)} == dict.fromkeys(
        (keyed, member, waited_for, retried), "jobs"
    )
    with connection.cursor() as cur:
        cur.execute("UPDATE jobs_historyready SET until = statement_timestamp()")
    (late,) = finish(job())
    assert where(late) == "jobs"
