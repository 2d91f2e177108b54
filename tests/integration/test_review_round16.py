"""Review round 16: the console's history (``jobs.queue.rollup``) and every statement that
adds to it (outcome writes, the worker's passes, sweeps, cancels), its compaction and reads.

The review found eight defects (a refused rollup wedging the worker and the sweeps, in-process
retries uncounted, their latency inflated, a cancelled hand-back uncounted, the hour fold
truncating in the session's zone, the fold scanning the table, quantiles capped at 49 min);
each was proven by a strict xfail test, fixed, and its test now pins the fix. The docstrings
say what used to go wrong. The other tests pin claims checked and found sound. Every test
runs on real PostgreSQL; concurrent ones use real threads and connections and poll with
deadlines.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.test import override_settings

from jobs import JobContext, Payload, RetryAfter, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.db.clock import database_now
from jobs.models import Job, Rollup
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    attempts,
    rollup,
    rollup_compaction,
    rollup_reads,
)
from jobs.testing import run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.factories import JobFactory
from tests.integration.test_worker_hardening import refusing_trigger, run_until, settled
from tests.runapp.jobs import DeliverV1
from tests.runapp.models import Delivery
from tests.worker_support import Echo, Hostile, Recorder, hostile_registry

NOOP = "test.noop.v1"
OTHER = "test.other.v1"


# -- helpers --------------------------------------------------------------------------------


def claim(count: int = 1, names=(NOOP,)):
    return queue.claim([ClaimRequest(n, count) for n in names], scope=AllTenants())


def totals() -> Counter[tuple[str, str, str]]:
    """Attempts per (name, outcome, code) over every rollup row, whatever its period."""
    with connection.cursor() as cur:
        cur.execute("SELECT name, outcome, code, sum(count) FROM jobs_rollup GROUP BY 1, 2, 3")
        return Counter({(n, o, c): int(k) for n, o, c, k in cur.fetchall()})


def every_bin(step=timedelta(hours=1)) -> list[rollup.Bin]:
    now = database_now()
    return rollup_reads.bins(now - timedelta(days=40), now + timedelta(hours=2), step)


def row_of(pk: int) -> Job:
    return Job.objects.get(pk=pk)


def wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout}s")


class Thread(threading.Thread):
    """A thread on its own connection that re-raises its error on ``result()``."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.error: BaseException | None = None
        self.value = None

    def run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 15):
        self.join(timeout)
        assert not self.is_alive(), "a test thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


def insert_row(
    period,
    *,
    width=rollup.MINUTE,
    name=NOOP,
    outcome="succeeded",
    code="",
    shard=0,
    count=1,
    run=None,
    wait=None,
):
    run = run or [0] * rollup.BUCKETS
    wait = wait or [0] * rollup.BUCKETS
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count,"
            " run_seconds, wait_seconds, run_histogram, wait_histogram)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                period,
                width,
                name,
                outcome,
                code,
                shard,
                count,
                float(count),
                float(count),
                run,
                wait,
            ],
        )


@contextlib.contextmanager
def refusing_rollup():
    """The rollup refuses every write, as it would for a worker role never granted the new
    table (a migration added it; the deployment grants privileges table by table)."""
    with connection.cursor() as cur:
        cur.execute(
            """
            CREATE FUNCTION review16_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'permission denied for table jobs_rollup'
                    USING ERRCODE = '42501';
            END $$;
            CREATE TRIGGER review16_refuse BEFORE INSERT OR UPDATE ON jobs_rollup
                FOR EACH ROW EXECUTE FUNCTION review16_refuse();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "DROP TRIGGER IF EXISTS review16_refuse ON jobs_rollup;"
                " DROP FUNCTION IF EXISTS review16_refuse()"
            )


def lock_rows_elsewhere(ids):
    """Hold FOR UPDATE on job rows in another session; returns (locked, release, thread)."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT id FROM jobs_job WHERE id = ANY(%s) FOR UPDATE", [list(ids)])
            locked.set()
            assert release.wait(15)

    thread = Thread(hold)
    thread.start()
    assert locked.wait(15)
    return release, thread


# -- 1. outcome writes -----------------------------------------------------------------------


@pytest.mark.django_db
def test_guard_one_batch_of_every_kind_counts_each_ended_attempt_once():
    """Succeeded, failed, retried, a retry of a cancel-requested attempt (cancelled), a
    success despite a cancel request (succeeded), a hand-back (nothing), a fenced outcome
    (nothing), duplicates of one outcome in a batch (once)."""
    JobFactory.create_batch(7)
    done, failed, retried, asked, asked_done, handed, twice = claim(7)
    assert queue.cancel_running([asked.id, asked_done.id], by="alice") == [
        asked.id,
        asked_done.id,
    ]
    fenced = JobFactory(running=True)
    ghost = replace(done, id=fenced.id, claim_token=uuid.uuid4())  # never this row's
    report = queue.record(
        [
            Outcome.succeeded(done),
            Outcome.failed(failed, code="handler_error", detail="boom"),
            Outcome.retry(retried, code="timeout", delay=60),
            Outcome.retry(asked, code="timeout", delay=60),
            Outcome.succeeded(asked_done),
            Outcome.released(handed),
            Outcome.failed(twice, code="handler_error"),
            Outcome.failed(twice, code="handler_error"),
            Outcome.succeeded(ghost),
        ]
    )
    assert set(report.fenced) == {fenced.id}
    assert totals() == {
        (NOOP, "succeeded", ""): 2,
        (NOOP, "failed", "handler_error"): 2,
        (NOOP, "retried", "timeout"): 1,
        (NOOP, "cancelled", "cancelled"): 1,
    }


@pytest.mark.django_db
def test_guard_a_stale_and_a_fresh_outcome_of_one_job_in_one_batch_count_the_fresh_one():
    JobFactory()
    [first] = claim()
    Job.objects.filter(pk=first.id).update(lease_expires_at=database_now() - timedelta(seconds=1))
    assert len(queue.requeue_expired()) == 1  # counted: retried / lease_expired
    [second] = claim()
    assert second.id == first.id and second.claim_token != first.claim_token

    report = queue.record([Outcome.succeeded(first), Outcome.failed(second, code="handler_error")])
    assert report.applied == (second.id,) and report.fenced == (first.id,)
    assert totals() == {
        (NOOP, "retried", "lease_expired"): 1,
        (NOOP, "failed", "handler_error"): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_guard_a_busy_outcome_counts_once_when_it_is_written_later():
    JobFactory.create_batch(2)
    busy, free = claim(2)
    release, holder = lock_rows_elsewhere([busy.id])
    try:
        report = queue.record([Outcome.succeeded(busy), Outcome.succeeded(free)])
        assert report.busy == (busy.id,) and report.applied == (free.id,)
        assert totals() == {(NOOP, "succeeded", ""): 1}
    finally:
        release.set()
        holder.result()
    report = queue.record([Outcome.succeeded(busy)])
    assert report.applied == (busy.id,)
    assert totals() == {(NOOP, "succeeded", ""): 2}


@pytest.mark.django_db(transaction=True)
def test_guard_an_outcome_in_a_transaction_that_rolls_back_counts_nothing():
    JobFactory()
    [job] = claim()

    class Undo(Exception):
        pass

    with contextlib.suppress(Undo), transaction.atomic():
        assert queue.complete(job)
        assert totals() == {(NOOP, "succeeded", ""): 1}
        raise Undo
    assert totals() == {}
    assert queue.complete(job)
    assert totals() == {(NOOP, "succeeded", ""): 1}


@pytest.mark.django_db
def test_a_handed_back_cancel_requested_job_is_counted_cancelled():
    """At shutdown the worker hands back jobs no handler has started. One an operator had
    asked to stop is not requeued: the write ends it ``cancelled`` (jobs.queue.outcomes,
    ``free.state``). The rollup skips every hand-back (``ran_attempt``), so the console's
    history never shows this job's end: its cancelled total disagrees with the jobs table
    (a cancel of a queued job, which ran nothing either, is counted)."""
    JobFactory()
    [job] = claim()
    assert queue.cancel_running([job.id], by="alice") == [job.id]
    report = queue.release([job])
    assert report.applied == (job.id,)
    assert row_of(job.id).state == "cancelled"
    assert totals() == {(NOOP, "cancelled", "cancelled"): 1}


@pytest.mark.django_db
def test_guard_replay_and_run_now_count_nothing():
    failed = JobFactory(failed=True)
    later = JobFactory(run_after=database_now() + timedelta(hours=1))
    assert queue.replay([failed.id], by="alice").replayed == (failed.id,)
    assert queue.run_now([later.id]) == [later.id]
    assert totals() == {}


@pytest.mark.django_db
def test_guard_odd_names_and_long_codes_are_counted_as_written():
    name = ("ü'\"\\%s;" * 40)[:200]
    JobFactory(name=name)
    [job] = claim(names=(name,))
    long_code = "x" * 31 + "é" + "tail that is cut"
    assert queue.fail(job, code=long_code, detail="d")
    assert totals() == {(name, "failed", long_code[:32]): 1}


@pytest.mark.django_db
def test_guard_one_statement_of_hundreds_of_outcomes_of_many_types():
    names = [f"review16.many.{k}.v1" for k in range(30)]
    for name in names:
        JobFactory.create_batch(10, name=name)
    jobs = claim(10, names=names)
    assert len(jobs) == 300
    outcomes, expected = [], Counter()
    for k, job in enumerate(jobs):
        kind = k % 4
        if kind == 0:
            outcomes.append(Outcome.succeeded(job))
            expected[(job.name, "succeeded", "")] += 1
        elif kind == 1:
            outcomes.append(Outcome.failed(job, code=f"code_{k % 7}"))
            expected[(job.name, "failed", f"code_{k % 7}")] += 1
        elif kind == 2:
            outcomes.append(Outcome.retry(job, code="timeout", delay=30))
            expected[(job.name, "retried", "timeout")] += 1
        else:
            outcomes.append(Outcome.released(job))
    report = queue.record(outcomes)
    assert len(report.applied) == 300
    assert totals() == expected
    assert sum(b.run.n for b in every_bin()) == sum(expected.values())


# -- 2. the worker's paths -------------------------------------------------------------------


class WaitOnceV1(Payload, name="review16.wait_once.v1"):
    """Raises RetryAfter(seconds) on its first attempt, succeeds on the next."""

    seconds: float = 0.05


class WaitOnceAsyncV1(Payload, name="review16.wait_once_async.v1"):
    seconds: float = 0.05


def wait_once(payload: WaitOnceV1, ctx: JobContext) -> dict:
    if ctx.attempt == 1:
        raise RetryAfter(payload.seconds)
    return {"attempt": ctx.attempt}


async def wait_once_async(payload: WaitOnceAsyncV1, ctx: JobContext) -> dict:
    if ctx.attempt == 1:
        raise RetryAfter(payload.seconds)
    return {"attempt": ctx.attempt}


def waiting_registry() -> Registry:
    policy = Policy(max_attempts=3, timeout=timedelta(seconds=10))
    return Registry(
        [
            JobType(WaitOnceV1, wait_once, policy),
            JobType(WaitOnceAsyncV1, wait_once_async, policy),
            JobType(Echo, lambda payload, ctx: payload.text, Policy(concurrency=4)),
        ]
    )


@pytest.mark.django_db(transaction=True)
def test_guard_the_worker_pass_counts_every_job_it_finishes():
    ids = [enqueue(Echo(text=f"e{i}")).id for i in range(12)]
    run_worker(registry=waiting_registry(), concurrency=4)
    assert {row_of(pk).state for pk in ids} == {"succeeded"}
    assert totals() == {(Echo.job_name, "succeeded", ""): 12}


@pytest.mark.django_db(transaction=True)
def test_guard_the_run_model_transaction_path_counts_each_attempt():
    from tests.runapp.jobs import deliver

    deliveries = [Delivery.objects.create(job_id=f"d-{i}") for i in range(3)]
    for row in deliveries:
        enqueue(DeliverV1(run_id=row.pk, plan=("error", "ok")))
    policy = Policy(run_model=Delivery, max_attempts=3, backoff=queue_backoff())
    run_worker(registry=Registry([JobType(DeliverV1, deliver, policy)]))
    assert totals() == {
        (DeliverV1.job_name, "retried", "handler_error"): 3,
        (DeliverV1.job_name, "succeeded", ""): 3,
    }


def queue_backoff():
    from jobs.catalogue.registry import Backoff

    return Backoff(base=0.01, cap=0.05)


@pytest.mark.django_db(transaction=True)
def test_guard_outcomes_written_one_by_one_count_once():
    """A batch the database refuses is rolled back whole and rewritten one by one: the
    refused outcome counts once as the failure it became, the others once each."""
    recorder = Recorder()
    with refusing_trigger("results saying refuse-me are refused", "check_violation"):
        ok = [queue.enqueue(NewJob(Hostile.job_name, {"action": "ok"})).id for _ in range(6)]
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "refuse-me"})).id
        run_until(
            hostile_registry(recorder), lambda w: settled(*ok, poison) and w.idle, concurrency=8
        )
    assert row_of(poison).state == "failed"
    assert totals() == {
        (Hostile.job_name, "succeeded", ""): 6,
        (Hostile.job_name, "failed", "handler_error"): 1,
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(WaitOnceV1(seconds=120.0), id="queued-retry-sync"),
        pytest.param(WaitOnceAsyncV1(seconds=120.0), id="queued-retry-async"),
        pytest.param(WaitOnceV1(seconds=0.05), id="in-process-sync"),
        pytest.param(WaitOnceAsyncV1(seconds=0.05), id="in-process-async"),
    ],
)
def test_an_in_process_retry_is_counted(payload):
    """The same handler raising the same RetryAfter: with a delay above
    RETRY_IN_PROCESS_UP_TO the retry goes back to the queue and counts ``retried``; with a
    short one it is waited out in the worker (jobs.queue.claim.next_attempt), whose
    statement logs the ended attempt as a retry in the attempt log but adds nothing to the
    rollup. The console's history then shows one attempt where the job ran two, and the
    failure rate of a type that retries in process reads 0 %."""
    done = enqueue(payload)
    if payload.seconds > 60:
        run_worker(registry=waiting_registry())
        Job.objects.filter(pk=done.id).update(run_after=database_now())  # skip the wait
    run_worker(registry=waiting_registry())
    job = row_of(done.id)
    assert (job.state, job.attempts) == ("succeeded", 2)
    assert [a.outcome for a in attempts.of(job)] == ["retry", "succeeded"]
    assert totals() == {
        (payload.job_name, "retried", "handler_error"): 1,
        (payload.job_name, "succeeded", ""): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_queue_latency_after_an_in_process_wait_leaves_the_wait_out():
    """Queue latency is "the attempt's start minus the time it became due". A job due now,
    claimed at once, raising RetryAfter(1.5): its second attempt became due when the wait
    ended and started right then, yet the rollup records ~1.5 s of queue latency for it
    (started_at is moved to the second attempt's start, run_after stays the first's due
    time). A type that retries in process looks like one starved by the queue."""
    done = enqueue(WaitOnceV1(seconds=1.5))
    run_worker(registry=waiting_registry())
    assert row_of(done.id).state == "succeeded"
    [item] = [b for b in every_bin() if b.name == WaitOnceV1.job_name and b.outcome == "succeeded"]
    assert item.wait.n == 1
    assert item.wait_seconds < 0.5, f"queue latency {item.wait_seconds:.2f}s"


# -- 3. sweeps and cancels -------------------------------------------------------------------


@pytest.mark.django_db
def test_guard_sweeps_count_each_branch_as_the_state_it_writes():
    now = database_now()
    expired = now - timedelta(seconds=5)
    retry = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    asked_retry = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    last = JobFactory(running=True, attempts=3, max_attempts=3, lease_expires_at=expired)
    asked_last = JobFactory(running=True, attempts=3, max_attempts=3, lease_expires_at=expired)
    over = JobFactory(attempts=3, max_attempts=3)  # queued, no attempt left: never ran again
    lowered = JobFactory(attempts=2, max_attempts=5)  # the type's limit lowered to 2
    fresh = JobFactory(running=True, attempts=1)  # lease still good: untouched
    Job.objects.filter(pk__in=[asked_retry.id, asked_last.id]).update(
        cancel_requested_at=now, cancel_requested_by="alice"
    )

    assert {r.id for r in queue.requeue_expired()} == {retry.id, asked_retry.id}
    assert {r.id for r in queue.fail_exhausted(max_attempts={NOOP: 2})} == {
        last.id,
        asked_last.id,
        over.id,
        lowered.id,
    }
    assert row_of(fresh.id).state == "running"
    assert totals() == {
        (NOOP, "retried", "lease_expired"): 1,
        (NOOP, "failed", "lease_expired"): 1,
        (NOOP, "failed", "attempts_exhausted"): 2,
        (NOOP, "cancelled", "cancelled"): 2,
    }
    # A swept attempt has no run time; one that was queued has no queue latency either.
    for item in every_bin():
        assert item.run.n == 0
        assert item.wait.n == (0 if item.code == "attempts_exhausted" else item.count)


@pytest.mark.django_db
def test_guard_a_cancel_counts_queued_jobs_only_and_once():
    queued = JobFactory.create_batch(3)
    running = JobFactory(running=True)
    ids = [j.id for j in queued] + [running.id]
    cancelled, asked = queue.cancel_active(ids, by="alice", running=True)
    assert sorted(cancelled) == sorted(j.id for j in queued) and asked == [running.id]
    assert queue.cancel(ids, by="bob") == []  # a second cancel ends nothing
    assert totals() == {(NOOP, "cancelled", "cancelled"): 3}


# -- 7. a rollup that cannot be written ------------------------------------------------------


@pytest.mark.django_db
def test_guard_a_refused_rollup_costs_its_counts_never_the_outcome():
    """A rollup that cannot be written is skipped (with a server-side warning): the outcome
    around it is written and reported applied, and nothing is counted."""
    JobFactory()
    [job] = claim()
    with refusing_rollup():
        assert queue.complete(job)
    assert row_of(job.id).state == "succeeded"
    assert totals() == {}


@pytest.mark.django_db
def test_a_refused_rollup_does_not_stop_recovery_of_dead_workers_jobs():
    """The sweeps carry the rollup CTE too. While it fails (a privilege not granted on the
    new table, the function missing, a lock or statement timeout on jobs_rollup), every
    requeue_expired and fail_exhausted statement fails whole, so no job of a dead worker is
    requeued or failed: invariant 5 (no job is lost) now depends on the console's charts."""
    expired = database_now() - timedelta(seconds=5)
    dead = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    with refusing_rollup():
        with contextlib.suppress(DatabaseError), transaction.atomic():
            queue.requeue_expired()
        assert row_of(dead.id).state == "queued", "the dead worker's job stays running"


@pytest.mark.django_db(transaction=True)
def test_a_refused_rollup_does_not_wedge_the_worker():
    """What happens today: the pass's statement fails; the worker writes the outcomes one by
    one (each fails), replaces each with a handler_error failure (fails too), then gives the
    job up to its lease, whose sweep fails as well. The handler ran and succeeded, and the
    job never leaves ``running``. Losing a count would be the lesser harm."""
    ids = [enqueue(Echo(text=f"e{i}")).id for i in range(3)]
    with refusing_rollup():
        config = WorkerConfig(
            poll_interval=0.05, install_signal_handlers=False, lease=timedelta(seconds=1)
        )
        worker = Worker(waiting_registry(), config)
        thread = Thread(worker.run)
        thread.start()
        try:
            wait_for(
                lambda: all(row_of(pk).state != "queued" for pk in ids), what="the jobs claimed"
            )
            # Well past the lease: both the outcome and the recovery had their chance.
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline and not settled(*ids):
                time.sleep(0.05)
        finally:
            worker.request_stop(force=True)
            thread.result()
        states = [row_of(pk).state for pk in ids]
    assert states == ["succeeded"] * 3, states


# -- 5. compaction ---------------------------------------------------------------------------


def epoch_rows() -> list[tuple[int, int, str, str, int, int]]:
    """(period as epoch seconds, width, outcome, code, shard, count), in key order."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT extract(epoch FROM period)::bigint, width, outcome, code, shard, count"
            " FROM jobs_rollup ORDER BY 1, 2, 3, 4, 5"
        )
        return cur.fetchall()


def utc_hour_back(hours: int) -> int:
    """The epoch of the UTC hour ``hours`` before this one."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT extract(epoch FROM date_trunc('hour', statement_timestamp(), 'UTC'))::bigint"
        )
        return cur.fetchone()[0] - hours * 3600


def at_epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


@pytest.mark.django_db
def test_guard_compaction_keeps_codes_and_merges_split_hours_into_present_hour_rows():
    """One hour's minute rows in several codes and shards, some already folded into the hour
    row by an earlier pass (an hour row present), folded in batches of 2: every count of
    every code lands in that hour once; rows exactly at the cut-offs stay as they are."""
    now = database_now().replace(microsecond=0)
    hour = utc_hour_back(4)
    insert_row(at_epoch(hour), width=rollup.HOUR, outcome="failed", code="timeout", count=5)
    for minute, code, shard in [
        (0, "timeout", 11),
        (7, "timeout", 12),
        (7, "oom", 11),
        (59, "", 0),
        (30, "oom", 0),
    ]:
        insert_row(
            at_epoch(hour + 60 * minute),
            code=code,
            shard=shard,
            count=minute + 1,
            outcome="failed" if code else "succeeded",
        )
    cut_hours = (now - rollup.MINUTES_KEPT).replace(second=0)
    cut_shards = (now - rollup.SHARD_FOLD_AFTER).replace(second=0)
    if cut_hours.timestamp() >= cut_shards.timestamp():  # pragma: no cover - constants
        pytest.skip("cut-offs overlap")
    insert_row(cut_shards, shard=33, count=100)  # at the shard cut-off: not yet folded
    now = cut_shards + rollup.SHARD_FOLD_AFTER  # exactly the cut-off
    rollup_compaction.compact(now, batch_size=2, max_batches=50)
    rows = epoch_rows()
    assert (int(cut_shards.timestamp()), rollup.MINUTE, "succeeded", "", 33, 100) in rows
    folded = {(o, c): n for p, w, o, c, s, n in rows if p == hour and w == rollup.HOUR}
    assert folded == {
        ("failed", "timeout"): 5 + 1 + 8,
        ("failed", "oom"): 8 + 31,
        ("succeeded", ""): 60,
    }
    assert all(
        p >= int((now - rollup.MINUTES_KEPT).timestamp()) for p, w, *_ in rows if w == rollup.MINUTE
    )


@pytest.mark.django_db
@override_settings(USE_TZ=False, TIME_ZONE="Asia/Kolkata")
def test_the_hour_fold_keeps_utc_hours_outside_utc():
    """``date_trunc('hour', m.period)`` uses the session's TimeZone, which Django sets to
    TIME_ZONE when USE_TZ is False (supported: review round 14). In Asia/Kolkata (+05:30)
    an attempt that ended at 10:05 UTC folds into the hour row of 09:30 UTC, which every
    reader (bins() bins by the epoch, in UTC) shows in the 09:00 bin. The minute chart put
    it in 10:00, the day chart after compaction in 09:00. date_trunc(…, 'UTC') would not."""
    hour = utc_hour_back(4)
    insert_row(at_epoch(hour + 5 * 60), shard=7, count=3)
    rollup_compaction.compact(database_now())
    [(period, width, *_rest)] = epoch_rows()
    assert width == rollup.HOUR
    assert period == hour, f"folded into the hour of {at_epoch(period):%H:%M} UTC"


@pytest.mark.django_db
def test_guard_backlog_fold_keeps_each_hours_largest_across_batches():
    hour = utc_hour_back(5)
    samples = [(3, 10, 1, 2.0), (17, 4, 9, None), (44, 7, 2, 30.0), (59, 1, 0, 1.0)]
    for minute, queued, due, oldest in samples:
        rollup.record_backlog([(NOOP, queued, due, oldest)], at=at_epoch(hour + 60 * minute))
    rollup.record_backlog([(NOOP, 99, 99, 99.0)], at=at_epoch(hour + 3600))  # the next hour
    rollup_compaction.compact(database_now(), batch_size=1, max_batches=50)
    points = rollup_reads.backlog_points(at_epoch(hour), at_epoch(hour + 7200), timedelta(hours=1))
    assert [(p.queued, p.due, p.oldest_due_seconds) for p in points] == [
        (10, 9, 30.0),
        (99, 99, 99.0),
    ]


# -- 8. cost ---------------------------------------------------------------------------------

THIRTY_DAYS_OF_HOURS = """
INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count, run_seconds,
                         wait_seconds, run_histogram, wait_histogram)
SELECT date_trunc('hour', statement_timestamp(), 'UTC') - (h + 3) * interval '1 hour', 3600,
       'type.' || n || '.v1', o, '', 0, 1, 1, 1, array_fill(0, ARRAY[45]),
       array_fill(0, ARRAY[45])
FROM generate_series(0, 24 * 30 - 4) AS h, generate_series(1, 40) AS n,
     unnest(ARRAY['succeeded', 'failed', 'retried']) AS o
"""
# The last two hours of minute rows (folded into shard 0) and this minute's per-session rows.
RECENT_MINUTES = """
INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count, run_seconds,
                         wait_seconds, run_histogram, wait_histogram)
SELECT date_trunc('minute', statement_timestamp()) - m * interval '1 minute', 60,
       'type.' || n || '.v1', 'succeeded', '', CASE WHEN m < 3 THEN 4242 ELSE 0 END, 1, 1, 1,
       array_fill(0, ARRAY[45]), array_fill(0, ARRAY[45])
FROM generate_series(0, 121) AS m, generate_series(1, 40) AS n
"""


def blocks_of(plan: dict) -> int:
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


@pytest.mark.django_db
def test_a_steady_state_fold_reads_only_minute_rows():
    """30 days of hour rows for 40 types (86,000 rows), two hours of minute rows: a
    retention pass has a minute's worth of rows to fold, yet every fold statement (shards,
    hours; the backlog table's likewise) reads every page of the table, every pass. The
    scheduler's loop has a statement timeout: on a large deployment the fold can outgrow it
    and then never runs again."""
    with connection.cursor() as cur:
        cur.execute(THIRTY_DAYS_OF_HOURS)
        cur.execute(RECENT_MINUTES)
        cur.execute("ANALYZE jobs_rollup")
        cur.execute("SELECT pg_relation_size('jobs_rollup') / current_setting('block_size')::int")
        (pages,) = cur.fetchone()
    plans: list[tuple[str, dict]] = []

    def explain(execute, sql, params, many, context):
        if sql.lstrip().startswith("WITH moved AS") and "jobs_rollup" in sql:
            with connection.cursor() as cur:
                cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
                plans.append((sql, cur.fetchone()[0][0]["Plan"]))
        return execute(sql, params, many, context)

    now = database_now()
    with connection.execute_wrapper(explain):  # each fold runs twice: explained, then as is
        rollup_compaction.compact(now)
    # Some per-session rows were old enough to fold; this minute's were not.
    assert 40 <= Rollup.objects.filter(width=rollup.MINUTE, shard=4242).count() < 3 * 40
    assert len(plans) == 2  # the shard fold and the hour fold, one statement each
    read = [blocks_of(plan) for _sql, plan in plans]
    assert max(read) < pages // 5, f"fold statements read {read} of {pages} pages"


# -- 4. concurrency --------------------------------------------------------------------------


def backend_pid() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_guard_an_open_fold_and_an_outcome_write_never_wait_on_each_other():
    """A fold that deleted this worker's old per-session rows and holds its transaction
    open does not stall the worker's outcome write; nor does a worker's open outcome
    transaction stall a fold. Each side runs under a short lock_timeout."""
    JobFactory.create_batch(2)
    first, second = claim(2)
    pid = backend_pid()
    old = database_now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    insert_row(old, shard=pid, count=4)  # this session's rows of ten minutes ago
    folded, release = threading.Event(), threading.Event()

    def fold_and_hold():
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '1s'")
            rollup_compaction.compact(database_now())
            folded.set()
            assert release.wait(15)

    holder = Thread(fold_and_hold)
    holder.start()
    try:
        assert folded.wait(15)
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '1s'")
        assert queue.complete(first)  # a wait on the fold's rows would time out
    finally:
        release.set()
        holder.result()
    assert totals() == {(NOOP, "succeeded", ""): 5}

    written, release = threading.Event(), threading.Event()

    def write_and_hold():
        with transaction.atomic():
            assert queue.complete(second)
            written.set()
            assert release.wait(15)

    holder = Thread(write_and_hold)
    holder.start()
    try:
        assert written.wait(15)
        rollup_compaction.compact(database_now() + timedelta(minutes=5))  # folds every minute row
    finally:
        release.set()
        holder.result()
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")
    assert totals() == {(NOOP, "succeeded", ""): 6}


# -- 6. reading ------------------------------------------------------------------------------


def test_guard_quantiles_of_degenerate_histograms():
    empty = rollup.Distribution()
    assert empty.quantile(0.5) is None
    fast = rollup.Distribution.of([0.0, 0.0002, -0.5, 0.0009])  # all below 1 ms (bucket 0)
    assert all(0 < fast.quantile(q) <= rollup.BOUNDS[0] for q in (0.01, 0.5, 0.99, 1.0))
    one = rollup.Distribution.of([3.0])
    assert rollup.BOUNDS[23] <= one.quantile(0.5) <= one.quantile(1.0) <= rollup.BOUNDS[24]
    with pytest.raises(ValueError):
        one.quantile(0)
    merged = rollup_reads.summed(
        [
            rollup.Bin(at_epoch(0), NOOP, "succeeded", "", 2, 1.0, 1.0, fast, fast),
            rollup.Bin(at_epoch(60), NOOP, "succeeded", "", 1, 3.0, 0.0, one, empty),
        ]
    )
    assert (merged.count, merged.run_seconds, merged.run.n, merged.wait.n) == (3, 4.0, 5, 4)
    assert rollup_reads.summed([]) is None


def test_quantiles_of_runs_of_hours_stay_within_a_bucket():
    """Jobs that run for hours (exports, backfills) all fall in the open last bucket, and
    Distribution.quantile returns its lower bound, 2,966 s, for every q: the performance
    page shows p50 = p95 = 49 min for a type whose every run took three hours. The bin's
    run_seconds total knows better (its mean is 3 h)."""
    three_hours = 3 * 3600.0
    runs = rollup.Distribution.of([three_hours] * 10)
    assert runs.quantile(0.5) == pytest.approx(three_hours, rel=0.2)
