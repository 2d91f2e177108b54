"""The lease watch: a handler is told to stop before its lease ends on the server, and only then.

A renewal that hangs on a silent network path: the lease keeper's connection goes through a
TCP proxy that stops forwarding (``freeze``), so no answer comes and no TCP timeout fires. A
lease that runs out meanwhile lets another worker take the job, so its handler must be told
to stop by then, whatever the call is doing, and the keeper must renew again once the path is
back. The watch gives a job up a lease after the last call that set its lease on the server
(``Running.leased_at``): never later than the server's lease end, and never for jobs whose
leases were renewed, under a slow or busy database (triggers on the jobs table that sleep on
the server), a slow claim, or a stop while a call hangs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction

import jobs
from jobs import JobContext, Payload, RetryAfter, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.queue import ClaimRequest, NewJob
from jobs.queue.types import AllTenants
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, make_context
from jobs.worker.leases import LeaseKeeper
from jobs.worker.runner import Worker
from tests.support.polling import wait_for
from tests.support.tcp_proxy import TcpProxy
from tests.support.worker import Echo, Recorder, Step, registry

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = 1.0


def claim_one() -> Running:
    queue.enqueue(NewJob(Echo.job_name, {"text": "x"}))
    [job] = queue.claim(
        [ClaimRequest(Echo.job_name, 1)], scope=AllTenants(), lease=timedelta(seconds=LEASE)
    )
    job_type = registry(Recorder())[Echo.job_name]
    return Running(job, job_type, make_context(job, job_type))


def lease_left(running: Running) -> float:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM lease_expires_at - statement_timestamp()) "
            "FROM jobs_job WHERE id = %s",
            [running.job.id],
        )
        return float(cur.fetchone()[0])


def test_a_hanging_renewal_still_stops_the_handler_within_its_lease(caplog):
    running = claim_one()
    held = [running]
    shared = connections.settings[DEFAULT_DB_ALIAS]  # new connections of every thread
    saved = {key: shared.get(key) for key in ("HOST", "PORT")}
    with TcpProxy() as proxy:
        connections[DEFAULT_DB_ALIAS].close()
        shared.update(HOST="127.0.0.1", PORT=str(proxy.port))
        keeper = LeaseKeeper(lambda: list(held), lease_seconds=LEASE, tick=0.02)
        try:
            keeper.start()  # its connection goes through the proxy; this thread's will not
            renewed = running.leased_at
            wait_for(lambda: running.leased_at > renewed, timeout=5, what="a first renewal")
        finally:
            shared.update(saved)
        with caplog.at_level(logging.WARNING, logger="jobs.worker"):
            proxy.freeze()  # every call of the keeper hangs from now on
            wait_for(running.ctx.cancelled.is_set, timeout=5, what="the handler told to stop")
            stopped = time.monotonic() - running.leased_at  # since its last renewal began
            assert running.lost, "no outcome will be written"
            # The hanging call is abandoned too, so the keeper can renew once the path is back.
            wait_for(lambda: "lease renewal of" in caplog.text, timeout=5, what="call aborted")

        proxy.thaw()
        fresh = claim_one()
        held.append(fresh)
        renewed = fresh.leased_at
        try:
            wait_for(lambda: fresh.leased_at > renewed, timeout=5, what="renewing again")
        finally:
            keeper.stop()
    # When its lease could end on the server (a lease after its last renewal began), give or
    # take a tick and this test's polling.
    assert stopped < LEASE + 0.25, stopped
    assert "lost the lease of job" in caplog.text
    assert lease_left(fresh) > 0


def claim_leased(lease: float) -> Running:
    queue.enqueue(NewJob(Echo.job_name, {"text": "x"}))
    before = time.monotonic()
    [job] = queue.claim(
        [ClaimRequest(Echo.job_name, 1)], scope=AllTenants(), lease=timedelta(seconds=lease)
    )
    job_type = registry(Recorder())[Echo.job_name]
    return Running(job, job_type, make_context(job, job_type), leased_at=before)


def server_lease_left(job_id: int) -> float:
    """Seconds until the row's lease ends on the server (a plain read: no lock waited for)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM lease_expires_at - clock_timestamp()) "
            "FROM jobs_job WHERE id = %s",
            [job_id],
        )
        return float(cur.fetchone()[0])


def ends_by_our_clock(running: Running, lease: float) -> float:
    """Seconds until the watch takes the job's lease to end: never after the server's end."""
    return running.leased_at + lease - time.monotonic()


@contextlib.contextmanager
def sleeping_trigger(when: str, seconds: float) -> Iterator[None]:
    """Updates of jobs rows matching ``when`` (a trigger's WHEN) take ``seconds`` longer."""
    with connection.cursor() as cur:
        cur.execute(
            f"""
            CREATE FUNCTION sleep_on_update() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_sleep({seconds}); RETURN NEW; END $$;
            CREATE TRIGGER sleep_on_update BEFORE UPDATE ON jobs_job
                FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION sleep_on_update();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute("DROP TRIGGER sleep_on_update ON jobs_job; DROP FUNCTION sleep_on_update()")


# A lease renewal: a running row stays running, in the same attempt, with a new lease.
RENEWAL = (
    "OLD.state = 'running' AND NEW.state = 'running' AND NEW.attempts = OLD.attempts "
    "AND NEW.lease_expires_at IS DISTINCT FROM OLD.lease_expires_at"
)


CLAIM = "OLD.state = 'queued' AND NEW.state = 'running'"


@contextlib.contextmanager
def row_locked(job_id: int) -> Iterator[None]:
    """Another session holds the job's row locked (an operator's open transaction)."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR UPDATE", [job_id])
                locked.set()
                release.wait(30)
        finally:
            connections[DEFAULT_DB_ALIAS].close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert locked.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def test_a_row_another_session_keeps_locked_is_given_up_before_its_lease_ends():
    # Renewals skip a locked row (SKIP LOCKED) and do not report it lost, but its lease is
    # not renewed either: it ends on the server a lease after the last renewal that wrote it.
    lease = 1.0
    running = claim_leased(lease)
    keeper = LeaseKeeper(lambda: [running], lease_seconds=lease, tick=0.02)
    keeper.start()
    try:
        renewed = running.leased_at
        wait_for(lambda: running.leased_at > renewed, timeout=5, what="a first renewal")
        with row_locked(running.job.id):
            # Whichever comes first: the watch gives the job up, or its lease ends.
            wait_for(
                lambda: running.lost or server_lease_left(running.job.id) <= 0,
                timeout=5,
                what="a give-up or the lease's end",
            )
            ends = ends_by_our_clock(running, lease), server_lease_left(running.job.id)
    finally:
        keeper.stop()
    assert running.lost, f"the lease ended on the server ({ends[1]:.3f}s), still held"
    assert ends[0] <= ends[1] + 0.02, ends


class CompleteSlowly(Payload, name="test.lease.complete_slowly.v1"):
    seconds: float


def complete_slowly(told: list[bool]):
    def handle(payload: CompleteSlowly, ctx: JobContext) -> None:
        with transaction.atomic(using=ctx.using):
            jobs.complete(ctx, "done")
            time.sleep(payload.seconds)  # the row stays locked by this transaction
        told.append(ctx.cancelled.is_set())

    return handle


def test_a_handler_holding_its_completed_row_past_its_lease_is_told_to_stop_and_completes():
    # jobs.complete() locks the job's row until the handler's transaction commits; held for
    # more than a lease, the watch gives the attempt up, and the commit still completes it.
    lease = 1.0
    told: list[bool] = []
    reg = Registry([JobType(CompleteSlowly, complete_slowly(told), Policy())])
    enqueued = queue.enqueue(NewJob(CompleteSlowly.job_name, {"seconds": 1.5 * lease}))
    config = WorkerConfig(
        concurrency=1,
        poll_interval=0.05,
        shutdown_timeout=1.0,
        install_signal_handlers=False,
        listen=False,
        lease=timedelta(seconds=lease),
    )
    deadline = time.monotonic() + 10
    Worker(reg, config).run(until=lambda w: (bool(told) and w.idle) or time.monotonic() > deadline)
    job = Job.objects.get(pk=enqueued.id)
    assert told == [True]
    assert (job.state, job.attempts, job.result) == ("succeeded", 1, "done")


def test_slow_but_successful_renewals_give_up_nothing():
    # Each renewal takes 20 % of the lease on the server: every lease is renewed in time.
    lease = 1.5
    running = claim_leased(lease)
    keeper = LeaseKeeper(lambda: [running], lease_seconds=lease, tick=0.02)
    with sleeping_trigger(RENEWAL, 0.3):
        keeper.start()
        try:
            deadline = time.monotonic() + 3 * lease
            least = lease
            while time.monotonic() < deadline:
                least = min(least, server_lease_left(running.job.id))
                assert not running.lost and not running.ctx.cancelled.is_set()
                time.sleep(0.05)
        finally:
            keeper.stop()
    assert least > 0, least


def test_renewals_that_time_out_give_the_job_up_before_its_lease_ends(caplog):
    # Renewals slower than their statement timeout (a third of the lease) are rolled back:
    # the lease is not renewed, and the job must be given up before it ends on the server.
    lease = 1.5
    running = claim_leased(lease)
    keeper = LeaseKeeper(lambda: [running], lease_seconds=lease, tick=0.02)
    with (
        caplog.at_level(logging.WARNING, logger="jobs.worker"),
        sleeping_trigger(RENEWAL, 0.9 * lease),
    ):
        keeper.start()
        try:
            wait_for(
                lambda: running.lost or server_lease_left(running.job.id) <= 0,
                timeout=5,
                what="a give-up or the lease's end",
            )
            ends = ends_by_our_clock(running, lease), server_lease_left(running.job.id)
        finally:
            keeper.stop()
    assert running.lost, f"the lease ended on the server ({ends[1]:.3f}s), still held"
    assert ends[0] <= ends[1] + 0.02, ends
    assert "lease renewal of 1 jobs failed" in caplog.text


def test_a_claims_lease_is_counted_from_before_the_claim_was_sent():
    # The claim's lease begins on the server when the statement starts; a slow claim (here
    # 0.4 s on the server) must not make the worker think its lease ends later than it does.
    lease = 30.0
    enqueued = queue.enqueue(NewJob(Step.job_name, {"plan": ["slow"], "seconds": 10}))
    seen: list[tuple[float, float]] = []

    def until(w: Worker) -> bool:
        with w.slots.lock:
            held = list(w.slots.held.values())
        if held:
            [running] = held
            seen.append((ends_by_our_clock(running, lease), server_lease_left(enqueued.id)))
            w.request_stop(force=True)
        return bool(seen)

    config = WorkerConfig(
        concurrency=1,
        poll_interval=0.05,
        shutdown_timeout=0.1,
        cancel_timeout=1.0,
        install_signal_handlers=False,
        listen=False,
        lease=timedelta(seconds=lease),
    )
    with sleeping_trigger(CLAIM, 0.4):
        Worker(registry(Recorder()), config).run(until=until)
    [(ours, server)] = seen
    assert ours <= server + 0.05, (ours, server)


def test_a_stop_while_a_renewal_hangs_returns_at_once():
    lease = 1.0
    running = claim_leased(lease)
    shared = connections.settings[DEFAULT_DB_ALIAS]  # new connections of every thread
    saved = {key: shared.get(key) for key in ("HOST", "PORT")}
    with TcpProxy() as proxy:
        connections[DEFAULT_DB_ALIAS].close()
        shared.update(HOST="127.0.0.1", PORT=str(proxy.port))
        keeper = LeaseKeeper(lambda: [running], lease_seconds=lease, tick=0.02)
        try:
            keeper.start()
            renewed = running.leased_at
            wait_for(lambda: running.leased_at > renewed, timeout=5, what="a first renewal")
        finally:
            shared.update(saved)
        proxy.freeze()
        wait_for(lambda: keeper._renewing_since is not None, timeout=5, what="a hanging pass")
        started = time.monotonic()
        keeper.stop()
        took = time.monotonic() - started
        proxy.thaw()
    assert took < 1.0, took
    assert not keeper._thread.is_alive()


# The next attempt of an in-process retry: the same claim, one attempt more.
NEXT_ATTEMPT = "OLD.state = 'running' AND NEW.state = 'running' AND NEW.attempts > OLD.attempts"


class RetryOnce(Payload, name="test.lease.retry_once.v1"):
    pass


def retry_once(calls: list[int], *, is_async: bool):
    def handle(payload: RetryOnce, ctx: JobContext) -> None:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise RetryAfter(0.05)  # waited out in the worker

    async def ahandle(payload: RetryOnce, ctx: JobContext) -> None:
        handle(payload, ctx)

    return ahandle if is_async else handle


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_job_given_up_while_its_next_attempt_is_recorded_is_not_run_again(is_async):
    # A short RetryAfter is waited out and the next attempt recorded (queue.next_attempt,
    # which locks the row: renewals skip it). Given up meanwhile, the job must not run again.
    lease = 1.0
    calls: list[int] = []
    reg = Registry([JobType(RetryOnce, retry_once(calls, is_async=is_async), Policy())])
    enqueued = queue.enqueue(NewJob(RetryOnce.job_name, {}))
    config = WorkerConfig(
        concurrency=1,
        poll_interval=0.05,
        shutdown_timeout=1.0,
        install_signal_handlers=False,
        listen=False,
        lease=timedelta(seconds=lease),
        recovery_interval=60.0,  # the given-up job is not claimed again within the test
        maintenance_interval=60.0,
    )
    deadline = time.monotonic() + 10

    def until(w: Worker) -> bool:
        if time.monotonic() > deadline:
            return True
        return Job.objects.get(pk=enqueued.id).attempts >= 2 and w.idle

    with sleeping_trigger(NEXT_ATTEMPT, 1.2 * lease):
        Worker(reg, config).run(until=until)
    assert Job.objects.get(pk=enqueued.id).attempts == 2, "the next attempt was recorded"
    assert calls == [1], "the handler ran again after the job was given up"
