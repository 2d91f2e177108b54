"""``async def`` handlers on the worker's one event loop, against real PostgreSQL.

They share one long-lived loop on its own thread (jobs/worker/event_loop.py), each job holding
its slot (jobs/worker/on_loop.py): many are in flight at once, deadlines, lost leases and
drains cancel their task, whatever they raise becomes an outcome, their ``sync_to_async``
calls run on a handler thread the job borrows, with its connection, and the loop closes at shutdown
with no task left pending.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.tasks import task

from jobs import JobContext, Payload, enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.testing import run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.event_loop import HandlerLoop
from jobs.worker.runner import Worker
from tests.support.polling import wait_for
from tests.support.worker import FAST_BACKOFF, Unruly

pytestmark = pytest.mark.django_db(transaction=True)


class Probe(Payload, name="test.async.probe.v1"):
    """Tells the async handler what to do: see ``probe``."""

    action: str = "ok"
    seconds: float = 0.0


class Seen:
    """What the handlers saw, shared with the test thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.started = 0
        self.cancelled = 0
        self.gate: asyncio.Event | None = None
        self.release = threading.Event()  # lets a task that swallows cancellation end
        self.left_behind: list[asyncio.Task] = []

    def record(self, **facts) -> None:
        with self.lock:
            self.calls.append(facts)


def probe(seen: Seen):
    async def handle(payload: Probe, ctx: JobContext):
        loop = asyncio.get_running_loop()
        seen.record(loop=loop, thread=threading.current_thread(), job=ctx.job_id)
        with seen.lock:
            seen.started += 1
        action = payload.action
        if action == "ok":
            return "ok"
        if action == "gate":  # wait until the test opens the gate
            if seen.gate is None:
                seen.gate = asyncio.Event()
            await asyncio.wait_for(seen.gate.wait(), timeout=20)
            return "passed"
        if action in ("sleep", "swallow-cancel"):
            try:
                await asyncio.sleep(payload.seconds)
            except asyncio.CancelledError:
                with seen.lock:
                    seen.cancelled += 1
                if action == "sleep":
                    raise
            return "slept"
        if action == "error":
            raise ConnectionError("upstream unavailable")
        if action == "keyboard-interrupt":
            raise KeyboardInterrupt
        if action == "system-exit":
            raise SystemExit(3)
        if action == "cancelled-error":
            raise asyncio.CancelledError
        if action == "unruly":
            raise Unruly("not an Exception")
        if action == "orm":
            return await sync_to_async(_thread_and_backend)()
        if action == "leave-transaction-open":
            await sync_to_async(_autocommit_off)()
            return None
        if action == "leave-task":
            seen.left_behind.append(asyncio.create_task(_forever()))
            return "left a task"
        if action == "leave-stubborn-task":
            seen.left_behind.append(asyncio.create_task(_stubborn(seen.release)))
            return "left a stubborn task"
        raise AssertionError(f"unknown action {action}")

    return handle


def _thread_and_backend() -> dict:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        (pid,) = cur.fetchone()
    return {"thread": threading.current_thread().name, "pid": pid}


def _autocommit_off() -> None:
    connection.set_autocommit(False)  # looked up here, on the thread that runs it


async def _forever() -> None:
    await asyncio.sleep(3600)


async def _stubborn(release: threading.Event) -> None:
    """Swallows every cancellation until the test releases it."""
    while not release.is_set():
        try:
            await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            continue


def registry(seen: Seen, **policy) -> Registry:
    options = {"timeout": timedelta(seconds=10), "max_attempts": 1, "backoff": FAST_BACKOFF}
    return Registry([JobType(Probe, probe(seen), Policy(**{**options, **policy}))])


def config(**options) -> WorkerConfig:
    return WorkerConfig(
        **{
            "concurrency": 4,
            "poll_interval": 0.05,
            "maintenance_interval": 0.5,
            "shutdown_timeout": 1.0,
            "install_signal_handlers": False,
            **options,
        }
    )


def drained(*ids: int):
    """until= for Worker.run: every job finished and every outcome written."""

    def done(worker: Worker) -> bool:
        states = Job.objects.filter(pk__in=ids).values_list("state", flat=True)
        return worker.idle and all(state in ("succeeded", "failed") for state in states)

    return done


def run(registry: Registry, *ids: int, timeout: float = 15.0, **options) -> Worker:
    """Run a real worker in this thread until these jobs are finished, or fail at the deadline."""
    worker = Worker(registry, config(**options))
    deadline = time.monotonic() + timeout
    done = drained(*ids)
    worker.run(until=lambda w: done(w) or time.monotonic() > deadline)
    unfinished = Job.objects.filter(pk__in=ids).exclude(state__in=("succeeded", "failed"))
    assert not unfinished.exists(), "jobs left unfinished at the deadline"
    return worker


def in_thread(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def row(enqueued) -> Job:
    return Job.objects.get(pk=enqueued.id)


@pytest.fixture
def seen():
    seen = Seen()
    yield seen
    seen.release.set()


def test_async_handlers_share_one_loop_whose_thread_outlives_each_job(seen):
    jobs = [enqueue(Probe()) for _ in range(4)]

    run(registry(seen), *(j.id for j in jobs), concurrency=1)

    loops = [call["loop"] for call in seen.calls]
    threads = [call["thread"] for call in seen.calls]
    assert len(loops) == 4
    assert all(loop is loops[0] for loop in loops), "one loop for every job"
    assert all(thread is threads[0] for thread in threads), "one loop thread for every job"
    assert threads[0].name.startswith("jobs-handler-loop")
    # Closed with the pool, after the last job: the loop lived across all four.
    assert loops[0].is_closed() and not threads[0].is_alive()
    assert {row(j).state for j in jobs} == {"succeeded"}


def test_fifty_async_handlers_are_in_flight_at_once_on_the_one_loop(seen):
    jobs = [enqueue(Probe(action="gate")) for _ in range(50)]
    worker = Worker(registry(seen), config(concurrency=50))
    thread = in_thread(worker)
    try:
        wait_for(lambda: seen.started == 50, timeout=20, interval=0.01)
        # All fifty wait on one asyncio.Event: only coroutines of one loop can.
        loop = seen.calls[0]["loop"]
        loop.call_soon_threadsafe(seen.gate.set)
        wait_for(
            lambda: (
                Job.objects.filter(pk__in=[j.id for j in jobs], state="succeeded").count() == 50
            ),
            timeout=20,
            interval=0.01,
        )
    finally:
        worker.request_stop()
        thread.join(15)
    assert {row(j).result for j in jobs} == {"passed"}
    assert len({id(call["loop"]) for call in seen.calls}) == 1


@pytest.mark.parametrize("action", ["sleep", "swallow-cancel"])
def test_overrunning_the_timeout_cancels_the_coroutine_as_deadline_exceeded(seen, action):
    job = enqueue(Probe(action=action, seconds=30))
    started = time.monotonic()

    run(registry(seen, timeout=timedelta(milliseconds=300)), job.id)

    # Cancelled at its await long before the 30 s sleep: the outcome of a sync handler that
    # stopped when told, whether the coroutine re-raised the cancellation or returned.
    assert time.monotonic() - started < 10
    assert seen.cancelled == 1
    assert (row(job).state, row(job).last_error) == ("failed", "deadline_exceeded")
    assert "over its 0.3s timeout" in row(job).error_detail


def test_overrunning_the_timeout_before_the_last_attempt_retries(seen):
    job = enqueue(Probe(action="sleep", seconds=30))

    worker = Worker(registry(seen, timeout=timedelta(milliseconds=200), max_attempts=2), config())
    thread = in_thread(worker)
    try:
        wait_for(lambda: seen.cancelled == 2, timeout=15, interval=0.01)
        wait_for(lambda: row(job).state == "failed", timeout=10, interval=0.01)
    finally:
        worker.request_stop()
        thread.join(15)
    assert (row(job).attempts, row(job).last_error) == (2, "deadline_exceeded")


def test_a_lost_lease_cancels_the_coroutine_and_writes_nothing(seen):
    job = enqueue(Probe(action="sleep", seconds=30))
    worker = Worker(registry(seen), config(lease=timedelta(seconds=0.3)))
    thread = in_thread(worker)
    try:
        wait_for(lambda: seen.started == 1, interval=0.01)
        Job.objects.filter(pk=job.id).update(claim_token="00000000-0000-0000-0000-000000000001")
        wait_for(lambda: seen.cancelled == 1, timeout=5, interval=0.01)
        wait_for(lambda: worker.idle, timeout=5, interval=0.01)  # the slot came back
    finally:
        worker.request_stop()
        thread.join(15)
    stolen = row(job)
    assert (stolen.state, stolen.attempts) == ("running", 1)
    assert str(stolen.claim_token) == "00000000-0000-0000-0000-000000000001"


def test_a_drain_cancels_a_coroutine_past_the_shutdown_timeout_and_hands_the_job_back(seen):
    long = enqueue(Probe(action="sleep", seconds=30))
    worker = Worker(registry(seen), config(shutdown_timeout=0.5, cancel_timeout=5.0))
    thread = in_thread(worker)
    wait_for(lambda: seen.started == 1, interval=0.01)
    stopping = time.monotonic()
    worker.request_stop()
    thread.join(15)
    assert not thread.is_alive()
    assert time.monotonic() - stopping < 5, "the cancelled coroutine returned at once"
    assert seen.cancelled == 1
    handed_back = row(long)
    assert (handed_back.state, handed_back.attempts, handed_back.claim_token) == (
        "queued",
        0,
        None,
    )


@pytest.mark.parametrize(
    ("action", "raised"),
    [
        ("error", "ConnectionError: upstream unavailable"),
        ("keyboard-interrupt", "KeyboardInterrupt"),
        ("system-exit", "SystemExit: 3"),
        ("cancelled-error", "CancelledError"),
        ("unruly", "Unruly: not an Exception"),
    ],
)
def test_what_a_coroutine_raises_becomes_its_outcome_and_frees_its_slot(
    seen, caplog, action, raised
):
    bad = [enqueue(Probe(action=action)) for _ in range(3)]
    good = [enqueue(Probe()) for _ in range(3)]

    worker = run(registry(seen), *(j.id for j in bad + good), concurrency=2)

    for job in bad:
        assert (row(job).state, row(job).last_error) == ("failed", "handler_error")
        assert raised in row(job).error_detail
    assert {row(j).state for j in good} == {"succeeded"}
    # No slot leaked, the loop survived every one of them, and the threads all lived on.
    assert worker.idle and worker.slots.in_flight == 0
    assert len({id(call["loop"]) for call in seen.calls}) == 1
    assert "died" not in caplog.text


def test_sync_to_async_calls_run_on_the_jobs_own_handler_thread_and_connection(seen):
    jobs = [enqueue(Probe(action="orm")) for _ in range(3)]

    run(registry(seen), *(j.id for j in jobs), concurrency=1)

    results = [row(j).result for j in jobs]
    # Not asgiref's one process-wide thread: the handler thread, whose connection the pool
    # keeps between jobs (HANDLER_CONN_MAX_AGE) and closes when it exits.
    assert all(r["thread"].startswith("jobs-handler-") for r in results), results
    assert not any("loop" in r["thread"] for r in results), results
    assert len({r["pid"] for r in results}) == 1, results
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)",
            [[r["pid"] for r in results]],
        )
        assert cur.fetchone() == (0,), "the handler thread closed its connection at exit"


def test_a_transaction_left_open_through_sync_to_async_is_caught_and_rolled_back(seen):
    job = enqueue(Probe(action="leave-transaction-open"))

    run(registry(seen), job.id)

    assert (row(job).state, row(job).last_error) == ("failed", "handler_error")
    assert "left a transaction open on database default" in row(job).error_detail


def test_shutdown_cancels_tasks_left_behind_and_closes_the_loop_with_nothing_pending(seen, caplog):
    job = enqueue(Probe(action="leave-task"))
    caplog.set_level(logging.DEBUG, logger="asyncio")
    caplog.set_level(logging.INFO, logger="jobs.worker")

    run(registry(seen), job.id)
    gc.collect()

    [call] = seen.calls
    [task] = seen.left_behind
    assert row(job).state == "succeeded"
    assert task.cancelled()
    assert call["loop"].is_closed() and not call["thread"].is_alive()
    assert "cancelling 1 tasks left on the handlers' event loop" in caplog.text
    assert "_forever" in caplog.text
    assert "destroyed but it is pending" not in caplog.text
    assert "never retrieved" not in caplog.text


def test_a_task_left_behind_that_swallows_cancellation_holds_no_slot(seen, caplog):
    """Under asyncio.run per call, such a task held its job and slot for ever."""
    job = enqueue(Probe(action="leave-stubborn-task"))
    other = enqueue(Probe())

    run(registry(seen), job.id, other.id, timeout=10, concurrency=1)

    assert (row(job).state, row(other).state) == ("succeeded", "succeeded")
    loop, loop_thread = seen.calls[0]["loop"], seen.calls[0]["thread"]
    # Shutdown could not close the loop under it: it waits for the task, then closes.
    assert "ignore their cancellation" in caplog.text
    assert loop_thread.is_alive() and not loop.is_closed()
    seen.release.set()
    wait_for(lambda: not loop_thread.is_alive(), timeout=5, interval=0.01)
    assert loop.is_closed()


@task
async def where_async_tasks_run() -> str:
    return threading.current_thread().name


def test_async_django_tasks_run_on_the_same_loop():
    """django.tasks calls async functions through async_to_sync, which finds the loop."""
    result = where_async_tasks_run.enqueue()

    run_worker()

    assert where_async_tasks_run.get_result(result.id).return_value == "jobs-handler-loop"


def test_the_watcher_warns_with_the_stack_when_code_blocks_the_loop(caplog):
    def blocking_handler_code() -> None:
        time.sleep(0.8)  # noqa: fixed-sleep  (blocking the loop is the scenario)

    async def blocks() -> None:
        blocking_handler_code()

    handler_loop = HandlerLoop("test-loop", blocked_after=0.4)
    try:
        asyncio.run_coroutine_threadsafe(blocks(), handler_loop.loop).result(5)
        wait_for(lambda: "has not run for" in caplog.text, timeout=5, interval=0.01)
    finally:
        assert handler_loop.close(2)
    assert "blocking_handler_code" in caplog.text
    assert caplog.text.count("has not run for") == 1, "one warning per stall"
