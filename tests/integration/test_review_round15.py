"""Review round 15: issue 14's engine side (pauses, cancel of running jobs, the attempt log,
the process beat in the lease renewal, ``manage.py jobs``).

Tests named ``test_bug_...`` failed on the reviewed code, each naming the defect it found
(all fixed since); ``test_guard_...`` pin properties checked and found sound. Every test runs
on real PostgreSQL; concurrent ones use real threads and connections and poll with deadlines.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from jobs import JobContext, Payload, RetryAfter, enqueue, queue
from jobs.catalogue.registry import Backoff, JobType, Policy, Registry
from jobs.control import cancels
from jobs.models import Job, Pause, TenantOverride
from jobs.queue import (
    AllTenants,
    AllTenantsExcept,
    ClaimRequest,
    NewJob,
    OnlyTenant,
    Outcome,
    ProcessBeat,
    attempts,
    bound,
    processes,
)
from jobs.queue.bound import RunRow
from jobs.scheduler.watchdog import Watchdog
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.acceptance.conftest import wait_for
from tests.integration.test_admin_factories import operator
from tests.runapp.jobs import DeliverV1
from tests.runapp.models import Delivery
from tests.worker_support import Recorder, Step, registry

NOOP = "test.noop.v1"
OTHER = "test.other.v1"


# -- helpers --------------------------------------------------------------------------------


def claim(names=(NOOP,), limit=100, scope=None, worker="w1", caps=None):
    requests = [ClaimRequest(n, limit, (caps or {}).get(n)) for n in names]
    return queue.claim(requests, scope=scope or AllTenants(), worker=worker)


def row_of(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


def expire(job_id: int) -> None:
    row = row_of(job_id)
    Job.objects.filter(pk=job_id).update(lease_expires_at=row.started_at - timedelta(seconds=1))


def numbers(job_id: int) -> list[int]:
    return [a.attempt for a in attempts.of(row_of(job_id))]


def db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


def lock_waiters() -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cur.fetchone()[0]


class Thread(threading.Thread):
    """A thread on its own database connection that re-raises its error on ``result()``."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.value = None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 10):
        self.join(timeout)
        assert not self.is_alive(), "a test thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


class RowLock:
    """Hold ``FOR UPDATE`` on rows of another session's transaction until released."""

    def __init__(self, sql: str, params: list) -> None:
        self.locked, self.release = threading.Event(), threading.Event()

        def hold() -> None:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(sql, params)
                self.locked.set()
                self.release.wait(30)

        self.thread = Thread(hold)

    def __enter__(self) -> RowLock:
        self.thread.start()
        assert self.locked.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.result()


# -- attempt history ------------------------------------------------------------------------


@pytest.mark.django_db
def test_bug_a_cancelled_hand_back_lists_an_attempt_twice():
    """A drain hands back a running attempt (Outcome.released) before the worker's renewal
    learned of the cancel: the outcome CTE turns it into ``cancelled`` but still applies the
    hand-back's ``attempts - 1``, and the row's columns now describe attempt 2's claim under
    attempt 1's number."""
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [first] = claim()
    queue.retry(first, code="handler_error", detail="boom")
    [second] = claim()  # attempt 2
    queue.cancel_running([second.id], by="alice")
    assert queue.record([Outcome.released(second)]).applied == (second.id,)
    row = row_of(second.id)
    assert row.state == "cancelled"

    listed = numbers(second.id)

    assert len(listed) == len(set(listed)), f"an attempt listed twice: {listed}"


@pytest.mark.django_db
@pytest.mark.parametrize("ending", ["cancel", "exhausted"])
def test_bug_a_job_ended_while_queued_after_a_hand_back_lists_an_attempt_twice(ending):
    """attempts.of takes the columns for an unlogged attempt when the log's last entry ended
    before ``started_at``; a hand-back leaves ``started_at`` at a claim that is not an
    attempt. Replay then writes the duplicate into the log for good."""
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [first] = claim()
    queue.retry(first, code="handler_error", detail="boom")
    [second] = claim()
    queue.release([second])  # a draining worker hands attempt 2 back untried
    assert row_of(first.id).attempts == 1
    if ending == "cancel":
        assert queue.cancel([first.id], by="alice") == [first.id]
    else:
        assert [r.id for r in queue.fail_exhausted(max_attempts={NOOP: 1})] == [first.id]

    listed = numbers(first.id)
    queue.replay([first.id], by="bob")
    logged = [a.attempt for a in attempts.read(row_of(first.id).attempt_log)]

    assert listed == [1], f"listed {listed}"
    assert logged == [1], f"logged {logged}"


@pytest.mark.django_db
def test_guard_error_text_with_nul_and_huge_tracebacks_is_logged_bounded_and_readable():
    queue.enqueue(NewJob(NOOP, max_attempts=5))
    [job] = claim()
    assert queue.next_attempt(job, code="handler\x00error", detail="a\x00b" + "x" * 100_000) == 2
    queue.retry(job, code="handler_error", detail="head\x00" + "y" * 50_000 + "tail")
    [again] = claim()
    expire(again.id)
    queue.requeue_expired()

    listed = attempts.of(row_of(job.id))

    assert [(a.attempt, a.outcome) for a in listed] == [
        (1, "retry"),
        (2, "retry"),
        (3, "lease_expired"),
    ]
    assert listed[0].code == "handler\\x00error"
    assert all(len(a.error) <= attempts.ERROR_MAX for a in listed)
    assert listed[1].error.endswith("tail")
    ends = [a.ended_at for a in listed]
    assert ends == sorted(ends)


@pytest.mark.django_db
def test_guard_a_row_from_before_the_log_reads_its_last_attempt_from_the_columns():
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [job] = claim()
    queue.retry(job, code="handler_error", detail="boom")
    [again] = claim()
    queue.fail(again, code="rejected", detail="no")
    Job.objects.filter(pk=job.id).update(attempt_log=[])  # written before the column existed

    [only] = attempts.of(row_of(job.id))

    assert (only.attempt, only.outcome, only.code, only.error) == (2, "failed", "rejected", "no")


# -- cancel of running jobs -----------------------------------------------------------------


@pytest.mark.django_db
def test_bug_a_cancelled_job_whose_worker_died_on_its_last_attempt_ends_failed():
    """The commonest cancel of a running job is of one that is stuck because its worker is
    gone; with no attempt left the watchdog's exhaustion pass takes it, not requeue_expired."""
    queue.enqueue(NewJob(NOOP, job_id="stuck", max_attempts=1))
    [job] = claim()
    assert queue.cancel_running([job.id], by="alice") == [job.id]
    expire(job.id)

    queue.requeue_expired()
    queue.fail_exhausted()

    row = row_of(job.id)
    assert (row.state, row.last_error) == ("cancelled", "cancelled")


@pytest.mark.django_db
def test_bug_a_cancelled_bound_job_whose_lease_expired_leaves_its_run_row_running():
    row = Delivery.objects.create(job_id="expired-cancel")
    done = enqueue(DeliverV1(run_id=row.pk))
    [job] = claim((DeliverV1.job_name,))
    bound.started(RunRow(Delivery, row.pk), attempt=1)  # the handler thread's first step
    queue.cancel_running([job.id], by="alice")
    expire(job.id)  # the worker died

    counts = Watchdog().run_once()

    assert counts["jobs.job:requeued"] == 1
    assert row_of(done.id).state == "cancelled"
    row.refresh_from_db()
    assert (row.state, row.last_error) == ("cancelled", "cancelled")


@pytest.mark.django_db
@pytest.mark.parametrize("outcome", ["retry", "released"])
def test_bug_a_cancelled_bound_job_leaves_its_run_row_queued(outcome):
    """The worker's own sequence (the pass, the drain's hand-back): the queue writes the
    outcomes, then moves the run rows of those applied, as they were written."""
    row = Delivery.objects.create(job_id=f"cancel-{outcome}")
    enqueue(DeliverV1(run_id=row.pk))
    [job] = claim((DeliverV1.job_name,))
    bound.started(RunRow(Delivery, row.pk), attempt=1)
    queue.cancel_running([job.id], by="alice")  # before the worker's next renewal
    made = (
        Outcome.retry(job, code="handler_error", delay=60)
        if outcome == "retry"
        else Outcome.released(job)
    )

    # As the worker does: the run row follows the outcome as written (report.as_written).
    queue.record([made], runs={job.claim_token: RunRow(Delivery, row.pk)})

    assert row_of(job.id).state == "cancelled"
    row.refresh_from_db()
    assert row.state == "cancelled", (
        f"the run row is {row.state} (next_retry_at {row.next_retry_at})"
    )


class WaitSyncV1(Payload, name="review15.wait_sync.v1"):
    run_id: int
    seconds: float = 5.0


class WaitAsyncV1(Payload, name="review15.wait_async.v1"):
    run_id: int
    seconds: float = 5.0


raised = threading.Event()


def wait_sync(payload: WaitSyncV1, ctx: JobContext) -> None:
    raised.set()
    raise RetryAfter(payload.seconds)  # short: waited out in the worker


async def wait_async(payload: WaitAsyncV1, ctx: JobContext) -> None:
    raised.set()
    raise RetryAfter(payload.seconds)


class SleepAsyncV1(Payload, name="review15.sleep_async.v1"):
    run_id: int


class StubbornV1(Payload, name="review15.stubborn.v1"):
    """Retries in process on every attempt; the first attempt waits for the test's go."""


go = threading.Event()
calls: list[int] = []
cancelled_seen: list[str] = []


async def sleep_async(payload: SleepAsyncV1, ctx: JobContext) -> None:
    raised.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancelled_seen.append("CancelledError")
        raise


def stubborn(payload: StubbornV1, ctx: JobContext) -> None:
    calls.append(ctx.attempt)
    if len(calls) == 1:
        raised.set()
        go.wait(10)
    raise RetryAfter(0.05)


def waiting_registry() -> Registry:
    policy = Policy(run_model=Delivery, max_attempts=3, backoff=Backoff(base=0.01, cap=0.05))
    return Registry(
        [
            JobType(WaitSyncV1, wait_sync, policy),
            JobType(WaitAsyncV1, wait_async, policy),
            JobType(SleepAsyncV1, sleep_async, policy),
            JobType(StubbornV1, stubborn, Policy(max_attempts=3)),
        ]
    )


def run_worker_until(done_id: int, predicate, *, lease: float, before=None):
    """Run a worker on waiting_registry() until ``predicate(row)``; stop it; the row."""
    config = WorkerConfig(lease=timedelta(seconds=lease), install_signal_handlers=False)
    worker = Worker(waiting_registry(), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        if before is not None:
            before()
        wait_for(lambda: predicate(row_of(done_id)), timeout=10, what="the job's state")
    finally:
        worker.request_stop(force=True)
        thread.join(10)
    return row_of(done_id)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_bug_a_cancel_during_an_in_process_retry_wait_leaves_the_run_row_queued(kind):
    raised.clear()
    row = Delivery.objects.create(job_id=f"wait-{kind}")
    payload = (WaitSyncV1 if kind == "sync" else WaitAsyncV1)(run_id=row.pk)
    done = enqueue(payload)
    config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
    worker = Worker(waiting_registry(), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]
        wait_for(lambda: row_of(done.id).state == "cancelled", timeout=10, what="job cancelled")
    finally:
        worker.request_stop(force=True)
        thread.join(10)
    row.refresh_from_db()
    assert row.state == "cancelled", (
        f"the run row is {row.state} (next_retry_at {row.next_retry_at})"
    )


@pytest.mark.django_db(transaction=True)
def test_bug_in_process_retries_run_on_after_a_cancel_and_end_the_job_failed():
    """The cancel commits before the handler's first RetryAfter; the worker has not renewed
    yet (a 30 s lease renews every 10 s). Recording the next attempt is a statement on the
    row, fenced by token, that could see the request, as a claim sees a pause."""
    raised.clear()
    go.clear()
    calls.clear()
    done = enqueue(StubbornV1())

    def cancel_then_go() -> None:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]
        go.set()

    row = run_worker_until(done.id, lambda r: r.state != "running", lease=30, before=cancel_then_go)

    assert (row.state, calls) == ("cancelled", [1]), (
        f"{row.state} / {row.last_error} after attempts {calls}"
    )


@pytest.mark.django_db(transaction=True)
def test_guard_an_async_bound_handler_cancelled_while_awaiting_ends_job_and_row_cancelled():
    raised.clear()
    cancelled_seen.clear()
    run = Delivery.objects.create(job_id="async-sleep")
    done = enqueue(SleepAsyncV1(run_id=run.pk))

    def cancel() -> None:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]

    row = run_worker_until(done.id, lambda r: r.state != "running", lease=0.6, before=cancel)

    assert (row.state, row.last_error, row.attempts) == ("cancelled", "cancelled", 1)
    assert [a.outcome for a in attempts.of(row)] == ["cancelled"]
    assert cancelled_seen == ["CancelledError"]
    run.refresh_from_db()
    assert (run.state, run.last_error) == ("cancelled", "cancelled")
    Delivery.objects.create(job_id="async-sleep")  # the active-state lock is free


@pytest.mark.django_db(transaction=True)
def test_bug_a_cancel_racing_a_retry_is_lost():
    alice = operator("alice", "jobs.cancel_job")
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [job] = claim()
    holding, go = threading.Event(), threading.Event()

    def worker_writes_a_retry() -> None:
        with transaction.atomic():
            assert queue.retry(job, code="handler_error", delay=3600)
            holding.set()
            go.wait(10)

    writer = Thread(worker_writes_a_retry)
    writer.start()
    assert holding.wait(10)
    canceller = Thread(lambda: cancels.cancel(alice, [job.id], via="test"))
    canceller.start()
    try:
        wait_for(
            lambda: lock_waiters() > 0 or not canceller.is_alive(),
            timeout=10,
            what="the cancel waits for the retry's row lock",
        )
    finally:
        go.set()
        writer.result()
    done = canceller.result()

    row = row_of(job.id)
    assert row.state == "cancelled", f"{row.state}; the cancel reported {done}"


@pytest.mark.django_db
def test_guard_a_stale_workers_outcome_does_not_undo_a_cancel_and_the_key_is_kept():
    queue.enqueue(NewJob(NOOP, job_id="k-stale", max_attempts=3))
    [stale] = claim()
    expire(stale.id)
    queue.requeue_expired()
    [fresh] = claim(worker="w2")
    queue.cancel_running([fresh.id], by="alice")
    # The stale worker's late outcomes, each kind, are fenced; the fresh one ends it cancelled.
    for late in (Outcome.succeeded(stale), Outcome.retry(stale, code="x"), Outcome.released(stale)):
        assert queue.record([late]).fenced == (stale.id,)
    assert queue.record([Outcome.cancelled(fresh)]).applied == (fresh.id,)
    row = row_of(fresh.id)
    assert (row.state, row.key_held, row.claimed_by) == ("cancelled", True, "w2")
    # Kept through FAILURE_WINDOW: the same key is the same job.
    assert queue.enqueue(NewJob(NOOP, job_id="k-stale")).created is False
    assert [(a.attempt, a.outcome, a.worker) for a in attempts.of(row)] == [
        (1, "lease_expired", "w1"),
        (2, "cancelled", "w2"),
    ]


# -- the process beat in the renewal --------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_bug_a_locked_process_row_blocks_the_lease_renewal():
    processes.register("h:1:aa", component="worker", host="h", pid=1, version="t", expires_in=10)
    queue.enqueue(NewJob(NOOP))
    [job] = claim(worker="h:1:aa")
    before = row_of(job.id).lease_expires_at
    beat = ProcessBeat("h:1:aa", 1, False, expires_in=10)

    with RowLock("SELECT 1 FROM jobs_process WHERE identity = %s FOR UPDATE", ["h:1:aa"]):
        renewer = Thread(lambda: queue.renew_leases([job], lease=timedelta(seconds=30), beat=beat))
        renewer.start()
        # (On failure the lock is released on leaving the block and the renewal returns.)
        wait_for(lambda: not renewer.is_alive(), timeout=3, what="the renewal returned")
    renewal = renewer.result()

    assert not renewal.lost
    assert row_of(job.id).lease_expires_at > before


@pytest.mark.django_db(transaction=True)
def test_bug_a_lock_on_a_workers_process_row_stops_its_lease_renewals():
    recorder = Recorder()
    done = enqueue(Step(plan=("slow",), seconds=30))
    config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
    worker = Worker(registry(recorder), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: recorder.calls, what="the handler started")
        wait_for(lambda: processes.status(config.identity), what="the worker registered")
        token = row_of(done.id).claim_token
        sql = "SELECT 1 FROM jobs_process WHERE identity = %s FOR UPDATE"
        with RowLock(sql, [config.identity]):  # an operator's open transaction, say
            # Every lease before the lock ends by locked_at + 0.6 s; a renewal after it, later.
            # (On the reviewed code the lease lapses, the worker's own maintenance requeues the
            # job and claims it again: a new token, another attempt used up.)
            locked_at = db_now()

            def renewed() -> bool:
                row = row_of(done.id)
                return row.claim_token == token and row.lease_expires_at > locked_at + timedelta(
                    seconds=0.6
                )

            wait_for(renewed, timeout=3, what="a renewal of the same claim after the lock")
        assert not recorder.calls[0][1].cancelled.is_set()
        assert len(recorder.calls) == 1
    finally:
        worker.request_stop(force=True)
        thread.join(10)


@pytest.mark.django_db
def test_guard_a_renewal_whose_process_row_is_gone_still_renews_and_reports_cancels():
    queue.enqueue(NewJob(NOOP))
    queue.enqueue(NewJob(NOOP))
    held = claim(worker="gone:1:aa")
    before = {j.id: row_of(j.id).lease_expires_at for j in held}
    queue.cancel_running([held[0].id], by="alice")

    renewal = queue.renew_leases(
        held, lease=timedelta(seconds=60), beat=ProcessBeat("gone:1:aa", 2, False, 10)
    )

    assert renewal.beat_missed and not renewal.lost
    assert renewal.cancel_requested == {held[0].claim_token}
    assert all(row_of(j.id).lease_expires_at > before[j.id] for j in held)


# -- pauses ---------------------------------------------------------------------------------


def _grid() -> list[int]:
    """Jobs of two types over two queues, two tenants, two priorities, due and delayed."""
    ids = []
    for name in (NOOP, OTHER):
        for queue_name in ("q1", "q2"):
            for tenant in ("t1", "t2"):
                for priority in (0, 5):
                    for delay in (None, timedelta(hours=1)):
                        ids.append(
                            queue.enqueue(
                                NewJob(
                                    name,
                                    queue=queue_name,
                                    tenant=tenant,
                                    priority=priority,
                                    delay=delay,
                                )
                            ).id
                        )
    return ids


@pytest.mark.django_db
@pytest.mark.parametrize("scope", ["all", "only_t1", "except_t2"])
@pytest.mark.parametrize("via", ["claim", "record_and_claim"])
def test_guard_pauses_only_remove_rows_from_the_claim(claim_form, scope, via):
    """With a queue and a tenant paused, a claim takes exactly what the same claim takes when
    those rows are simply not there: same order, same per-name limits, same caps."""
    _grid()
    TenantOverride.objects.create(tenant="t2", component="worker")
    the_scope = {
        "all": AllTenants(),
        "only_t1": OnlyTenant("t1"),
        "except_t2": AllTenantsExcept("worker"),
    }[scope]
    Job.objects.filter(name=OTHER, priority=5, tenant="t1").update(attempts=2)  # over the cap
    queue.pause("queue", "q2", by="alice")
    queue.pause("tenant", "t2", by="alice")
    requests = [ClaimRequest(OTHER, 3, 2), ClaimRequest(NOOP, 2)]
    eligible = Job.objects.filter(
        state="queued", queue="q1", tenant="t1", run_after__lte=db_now()
    ).exclude(name=OTHER, attempts__gte=2)

    def expected(name, limit):
        rows = eligible.filter(name=name).order_by("-priority", "run_after", "id")
        return list(rows.values_list("id", flat=True)[:limit])

    want = expected(OTHER, 3) + expected(NOOP, 2)
    if via == "claim":
        got = queue.claim(requests, scope=the_scope, worker="w")
    else:
        queue.enqueue(NewJob("test.third.v1"))
        [third] = queue.claim([ClaimRequest("test.third.v1", 1)], scope=AllTenants())
        report, got = queue.record_and_claim(
            [Outcome.succeeded(third)], requests, scope=the_scope, worker="w"
        )
        assert report.applied == (third.id,)

    assert [j.id for j in got] == want
    assert want  # the grid leaves something to claim


@pytest.mark.django_db(transaction=True)
def test_guard_no_claim_started_after_the_pause_committed_takes_a_paused_job(claim_form):
    """Claimers on their own connections race a pause; every claim statement issued after
    pause() returned (committed) takes nothing of the paused type."""
    for _ in range(60):
        queue.enqueue(NewJob(NOOP))
        queue.enqueue(NewJob(OTHER))
    committed = threading.Event()
    stop = threading.Event()
    walk = claim_form == "walk"

    def claimer() -> list[tuple[bool, list[str]]]:
        if walk:
            connection.ensure_connection()
            connection.pg_version = 170000
        seen = []
        while not stop.is_set():
            after = committed.is_set()
            got = claim((NOOP, OTHER), limit=1)
            seen.append((after, [j.name for j in got]))
            if not got and after:
                break
        return seen

    claimers = [Thread(claimer) for _ in range(4)]
    for t in claimers:
        t.start()
    wait_for(lambda: Job.objects.filter(state="running").exists(), what="claims under way")
    queue.pause("job_type", NOOP, by="alice")
    committed.set()
    try:
        wait_for(lambda: not any(t.is_alive() for t in claimers), timeout=20, what="claimers")
    finally:
        stop.set()
    results = [t.result() for t in claimers]

    late = [names for seen in results for after, names in seen if after]
    assert late, "some claims ran after the pause"
    assert all(NOOP not in names for names in late)
    assert Job.objects.filter(name=NOOP, state="queued").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["queue", "tenant"])
@pytest.mark.parametrize("value", ["emails ", " emails", "two words", "x" * 65])
def test_bug_a_pause_that_can_never_match_is_accepted(kind, value):
    """pauses.validate promises to refuse 'a value that could never name anything'; queues
    and tenants are keys (jobs.core.limits.validate_key) at enqueue."""
    queue.enqueue(NewJob(NOOP, **{kind: "emails"}))
    with pytest.raises(ValueError):
        queue.pause(kind, value, by="alice")


# -- manage.py jobs -------------------------------------------------------------------------


@pytest.mark.django_db
def test_bug_cancel_all_with_a_limit_of_zero_cancels_a_job():
    operator("alice", "jobs.cancel_job")
    queue.enqueue(NewJob(NOOP))
    queue.enqueue(NewJob(NOOP))

    with pytest.raises(CommandError):
        call_command(
            "jobs", "cancel", "--all", "--limit", "0", "--user", "alice", stdout=StringIO()
        )

    assert Job.objects.filter(state="queued").count() == 2


@pytest.mark.django_db
def test_guard_the_command_refuses_non_staff_and_users_without_the_permission():
    operator("nostaff", "jobs.cancel_job", "jobs.pause_work", staff=False)
    operator("noperm")
    queue.enqueue(NewJob(NOOP))
    for user in ("nostaff", "noperm", "nobody"):
        with pytest.raises(CommandError):
            call_command("jobs", "cancel", "--all", "--user", user, stdout=StringIO())
        with pytest.raises(CommandError):
            call_command("jobs", "pause", "queue", "q", "--user", user, stdout=StringIO())
    assert Job.objects.get().state == "queued" and not Pause.objects.exists()
