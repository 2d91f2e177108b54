"""Review round 13: the claim's priority walk (daf7098) and the history table (ec1ea7c).

Tests marked FINDING fail on the reviewed code and pass once the finding is fixed; the others
(GUARD) pass and pin behaviour that a fix must keep. Every test runs on real PostgreSQL;
concurrent ones use real threads (each with its own connection) and poll with deadlines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.urls import reverse

from jobs import queue
from jobs.control.replays import replay as monitor_replay
from jobs.control.tables import RunTable
from jobs.models import Job, JobHistory, ScheduleSlot
from jobs.queue import AllTenants, ClaimRequest, NewJob, OnlyTenant, history
from jobs.queue.history import HOUR, _floor
from jobs.scheduler.clock import database_now
from jobs.scheduler.retention import Archive, Retention
from tests.support.admin import client_for, operator
from tests.support.concurrency import Background
from tests.support.history import NAME, finish, job, where
from tests.support.polling import wait_for

MINUTE = timedelta(minutes=1)


# -- helpers --------------------------------------------------------------------------------


def lock_waiters(like: str = "%") -> int:
    """Sessions of this database waiting on a heavyweight lock, running a query like ``like``."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query LIKE %s",
            [like],
        )
        return cur.fetchone()[0]


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


# -- replay across the boundary ------------------------------------------------------------


@pytest.mark.django_db
def test_replaying_a_jobs_row_the_archive_moved_meanwhile_still_replays_it():
    """FINDING (medium-high): the monitor/admin/CLI replay of ``jobs.job:<id>`` finds nothing.

    The failure monitor lists a failed keyless job as ``jobs.job:<id>``; ten seconds after it
    failed (ARCHIVE_AFTER) the archive moves it. The operator's confirmation then goes to
    ``_replay_table`` for the jobs table, whose ``eligible_pks`` reads ``jobs_job`` only: the
    row is "no longer eligible" and nothing is replayed, although ``queue.replay`` itself
    would restore it. Same for the Job admin's replay action/button on a stale page.
    """
    (pk,) = finish(job(), state="failed")
    table = RunTable(Job)
    assert table.eligible_pks([pk]) == [pk]  # what the operator's page offered
    history.archive(now=database_now() + MINUTE)
    assert where(pk) == "history"
    alice = operator("alice", "jobs.view_job", "jobs.replay_job")

    (result,) = monitor_replay(alice, {table: [pk]}, via="test")

    assert result.replayed == (pk,), "the archived failed job was not replayed"
    assert Job.objects.get(pk=pk).state == "queued"


@pytest.mark.django_db
def test_manage_py_replay_by_id_replays_a_job_that_was_archived():
    """FINDING (medium-high): ``manage.py replay <id>`` (default ``--model jobs.job``).

    Every failed keyless job is archived 10 s after it fails, so a script that replays the
    ids it was alerted about replays nothing and says "1 row was not replayed: it is no
    longer eligible (not failed, or already replayed)", which is false.
    """
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + MINUTE)
    operator("ops", "jobs.view_job", "jobs.replay_job")
    out = StringIO()

    call_command("replay", str(pk), "--user", "ops", stdout=out)

    assert where(pk) == "jobs" and Job.objects.get(pk=pk).state == "queued", out.getvalue()


@pytest.mark.django_db
def test_a_history_replay_records_only_the_rows_it_replayed():
    """FINDING (medium): a key-taken history row is reported and logged as replayed.

    The history's replay returns a count; with a partial count ``_which`` asks which rows are
    "no longer eligible" by reading the history. RESTORE moved every failed row back to
    ``jobs_job`` first, including the one whose key a newer job holds (it stays failed there),
    so that row has left the history too and is counted as replayed: the operator reads
    "Replayed 2 rows" and a LogEntry says so, while the job never runs.
    """
    (taken,) = finish(job("import-13"), state="failed")
    (free,) = finish(job(), state="failed")
    history.archive(now=database_now() + 2 * MINUTE)
    assert where(taken) == where(free) == "history"
    newer = queue.enqueue(job("import-13"))
    assert newer.created
    alice = operator("alice", "jobs.view_job", "jobs.replay_job")

    (result,) = monitor_replay(alice, {RunTable(JobHistory): [taken, free]}, via="test")

    # Key taken: it did not replay, and stays failed where it was (fixed: in the history).
    assert JobHistory.objects.get(pk=taken).state == "failed"
    assert Job.objects.get(pk=free).state == "queued"
    assert result.replayed == (free,)
    assert not LogEntry.objects.filter(object_id=str(taken)).exists()


@pytest.mark.django_db(transaction=True)
def test_a_replay_racing_an_archive_of_the_same_row_replays_it():
    """FINDING (low-medium): a replay that meets the archive mid-move loses the row's report.

    replay() runs RESTORE (history -> jobs) first, while the archive's DELETE ... INSERT is
    not committed yet: RESTORE sees no history row. The replay's UPDATE then waits on the row
    lock of the archive's DELETE and, once it commits, finds the row gone. The report has the
    id in none of replayed / not_failed / key_taken, and the failed job is left in history.
    Fix: lock the ids' jobs rows (FOR UPDATE, waits for an in-flight move) before RESTORE,
    or re-run RESTORE + UPDATE for ids found in neither table.
    """
    (pk,) = finish(job(), state="failed")
    later = database_now() + MINUTE
    with connection.cursor() as cur:  # no DDL inside the racing transaction
        history.ensure(cur, "failed", later - timedelta(days=1), later + timedelta(days=1))
    moved, release = threading.Event(), threading.Event()

    def archive_held_open() -> Any:
        with transaction.atomic():
            counts = history.archive(now=later)
            moved.set()
            release.wait(60)
        return counts

    archiver = Background(archive_held_open)
    assert moved.wait(30)
    replayer = Background(lambda: queue.replay([pk], by="alice"))
    wait_for(
        lambda: lock_waiters("%FOR UPDATE%") == 1, what="the replay to wait on the row", timeout=30
    )
    release.set()
    assert archiver.result() == {"failed": (1, 1)}
    report = replayer.result()

    accounted = report.replayed + report.not_failed + report.key_taken
    assert pk in accounted, f"replay reported nothing about {pk}: {report}; row in {where(pk)}"
    assert report.replayed == (pk,)


@pytest.mark.django_db
def test_replay_of_an_archived_succeeded_job_reports_it_not_failed():
    """FINDING (low): ``ReplayReport.not_failed`` no longer names archived succeeded rows.

    Before the history, replay([id of a succeeded job]) reported it as not_failed; now that
    row sits in the history, the report's query reads jobs_job only and drops the id.
    """
    (pk,) = finish(job())
    history.archive(now=database_now() + MINUTE)
    assert where(pk) == "history"

    report = queue.replay([pk], by="alice")

    assert report.not_failed == (pk,), report


# -- partitions: locks, concurrency, clocks -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_long_reader_of_the_history_does_not_stop_the_archive():
    """FINDING (medium): a new partition needs ACCESS EXCLUSIVE on the state's partition.

    ``CREATE TABLE … PARTITION OF jobs_jobhistory_<state>`` conflicts with any open read of
    the history (a report, the admin's count, a nightly pg_dump holds ACCESS SHARE for
    hours). Succeeded rows need a new partition every hour; under the scheduler's
    DB_LOCK_TIMEOUT the CREATE fails and the whole pass raises before it reaches the failed
    and cancelled states, so nothing is archived for as long as the reader runs, and
    jobs_job grows. (Without a lock timeout the pass would queue every later reader of the
    history behind it instead.) Fix: create partitions ahead of need, and as CREATE TABLE +
    ATTACH PARTITION (SHARE UPDATE EXCLUSIVE, no conflict with readers); on a lock timeout
    skip that state for this pass instead of failing the pass.
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
    """FINDING (low-medium): one partition that cannot be dropped fails the whole duty.

    The DROP waits behind any reader of the history; under DB_LOCK_TIMEOUT it raises out of
    ``Retention.run_once``, which then never prunes the cron slots (called after it) and logs
    nothing of what it did delete. While a long reader runs (pg_dump), every pass fails.
    Fix: catch the lock timeout per partition (try again next pass) and go on.
    """
    now = database_now()
    old = now - timedelta(days=30)  # CANCELLED_RETENTION is 7 days: wholly expired
    with connection.cursor() as cur:
        history.ensure(cur, "cancelled", old, old)
    for days in (60, 59):
        ScheduleSlot.objects.create(
            schedule="review13",
            slot=now - timedelta(days=days),
            kind="on_time",
            job_id=f"cron:review13:{days}",
        )

    error = None
    with history_reader(), lock_timeout("1s"):
        try:
            Retention().run_once()
        except OperationalError as exc:
            error = exc

    assert error is None, f"retention failed behind a reader: {error}"
    assert ScheduleSlot.objects.filter(schedule="review13").count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_archive_passes_needing_the_same_new_partition_both_succeed():
    """FINDING (low): ``CREATE TABLE IF NOT EXISTS … PARTITION OF`` is not safe concurrently.

    Both passes find the partition missing before either takes the parent's lock; the second
    then creates it again and fails with "relation already exists". Two passes overlap when
    leadership moves while the old leader is mid-pass, or when someone calls
    ``history.archive()`` by hand. (The existing concurrency test creates the partitions
    before the race to avoid exactly this.) Fix: take an advisory lock around ensure(), or
    catch DuplicateTable and re-read the catalog.
    """
    (pk,) = finish(job())
    now = database_now()
    moment = now - 9 * HOUR
    finished_at(pk, moment)
    drop_partitions_covering("succeeded", moment)

    # Fixed: partitions are attached under an advisory lock, so the passes take turns (and a
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
    """FINDING (low-medium): with ``USE_TZ = False`` both duties raise TypeError every pass.

    Django then returns naive datetimes; ``plan()`` compares aware partition hours with the
    naive cutoff, and ``drop_expired`` aware partition bounds with the naive ``now``. The
    retention duty worked with USE_TZ = False before this change (prune passes ``now`` to SQL)
    and now fails before pruning cron slots; nothing is ever archived. Fix: normalise ``now``
    and ``oldest`` to aware UTC (``timezone.make_aware`` in the session's zone) at the top of
    archive/drop_expired, or refuse USE_TZ = False with a system check.
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


# -- docs against code -----------------------------------------------------------------------


@pytest.mark.django_db
def test_an_archive_pass_makes_at_most_max_batches_statements_per_state():
    """FINDING (low, docs): "at most 20 statements of 5,000 rows per state" is 40.

    The pass loops ``max_batches`` times for rows that let go of their key and again for key
    holders whose window passed, so a state moves up to twice what docs/queue.md and the
    ArchiveConfig comment ("statements per state and pass") promise. Fix the docs or share
    one batch count across both ranges.
    """
    for _ in range(2):
        finish(job(), state="failed")  # keyless: let go at the finish
    for key in ("doc-a", "doc-b"):
        finish(job(key), state="failed")  # keyed: hold through FAILURE_WINDOW (1 minute)

    moved = history.archive(batch_size=1, max_batches=1, now=database_now() + 2 * MINUTE)

    assert moved["failed"][0] <= 1, moved


# -- guards: what held -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_guard_enqueue_racing_the_archive_of_its_expired_key_holder_makes_one_job(threads):
    """GUARD: enqueues of a key whose old holder the archive is moving agree on one new row."""
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
def test_guard_a_row_is_always_in_exactly_one_table_while_the_archive_runs(threads):
    """GUARD: readers never see a moving row in both tables or in neither (one statement).

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
def test_guard_claim_walks_priorities_in_order_past_delayed_and_other_tenants_rows():
    """GUARD: the walk keeps (priority DESC, run_after, id) and the tenant scope.

    Delayed rows and rows of another tenant at higher priorities are stepped over, never
    claimed; the due rows come highest priority first, earliest due first within one.
    """
    now = database_now()
    jobs = [
        NewJob(name=NAME, payload={}, priority=50, run_after=now + HOUR, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=40, tenant="t2"),
        NewJob(name=NAME, payload={}, priority=30, run_after=now - 2 * MINUTE, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=30, run_after=now - 5 * MINUTE, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=-100, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=100, run_after=now + HOUR, tenant="t1"),
    ]
    ids = [e.id for e in queue.enqueue_many(jobs)]

    claimed = queue.claim([ClaimRequest(NAME, 10)], scope=OnlyTenant("t1"), worker="w")

    assert [c.id for c in claimed] == [ids[3], ids[2], ids[4]]


@pytest.mark.django_db(transaction=True)
def test_guard_claim_locks_only_what_it_takes():
    """GUARD: rows are locked only as the LIMIT pulls them, across priorities and names.

    Inside an open claim of 3 (two names, three priorities), every other due row can still be
    locked by another session with SKIP LOCKED.
    """
    other = "test.history.other.v1"
    jobs = [NewJob(name=NAME, payload={}, priority=p) for p in (5, 5, 0, 0, -5, -5)]
    jobs += [NewJob(name=other, payload={}, priority=1) for _ in range(4)]
    queue.enqueue_many(jobs)
    held, release = threading.Event(), threading.Event()

    def claim_held_open() -> Any:
        with transaction.atomic():
            got = queue.claim(
                [ClaimRequest(NAME, 2), ClaimRequest(other, 4)],
                scope=AllTenants(),
                limit=3,
                worker="w",
            )
            held.set()
            release.wait(60)
        return got

    claimer = Background(claim_held_open)
    assert held.wait(30)
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM (SELECT id FROM jobs_job WHERE state = 'queued' "
                "FOR UPDATE SKIP LOCKED) s"
            )
            (lockable,) = cur.fetchone()
    finally:
        release.set()
    got = claimer.result()
    assert len(got) == 3
    assert [c.priority for c in got[:2]] == [5, 5] and got[2].name == other
    assert lockable == 10 - 3


@pytest.mark.django_db
def test_guard_history_is_not_readable_with_unrelated_jobs_permissions():
    """GUARD: a staff user with only TenantOverride permissions sees no finished jobs."""
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + MINUTE)
    user = operator("tenants", "jobs.view_tenantoverride", "jobs.change_tenantoverride")
    client = client_for(user)
    assert client.get(reverse("admin:jobs_jobhistory_changelist")).status_code == 403
    assert client.get(reverse("admin:jobs_jobhistory_change", args=[pk])).status_code == 403
    assert not RunTable(JobHistory).can_replay(user)


@pytest.mark.django_db
def test_guard_retention_never_drops_a_partition_holding_a_row_inside_its_retention():
    """GUARD: a kept row survives every drop until its own retention has passed."""
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
