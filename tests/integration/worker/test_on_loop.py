"""Async jobs run as tasks on the worker's loop and borrow a handler thread only for sync steps.

While they await they hold no handler thread; their run rows, in-process RetryAfter waits,
open-transaction checks and ``sync_to_async`` ORM calls still run on a handler thread (one per
job, with its own connection), and a bug in the dispatch to the loop leaks no slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from jobs import JobContext, Payload, RetryAfter, enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import executor
from jobs.worker.executor import Executor
from jobs.worker.runner import Worker
from tests.runapp.models import Delivery
from tests.support.polling import wait_for
from tests.support.worker import FAST_BACKOFF, run_jobs, worker_config

pytestmark = pytest.mark.django_db(transaction=True)


class Act(Payload, name="test.async.on_loop.v1"):
    action: str = "ok"
    run_id: int = 0


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: asyncio.Event | None = None
        self.contexts: list[JobContext] = []
        self.orm: dict[str, list[dict]] = {}
        self.rows: list[tuple[str, int]] = []
        self.meet = threading.Barrier(2, timeout=10)


def _backend() -> dict:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        (pid,) = cur.fetchone()
    return {"thread": threading.current_thread().name, "pid": pid}


def _row(pk: int) -> tuple[str, int]:
    row = Delivery.objects.get(pk=pk)
    return row.state, row.attempts


def handler(seen: Seen):
    async def handle(payload: Act, ctx: JobContext):
        with seen.lock:
            seen.started += 1
            seen.loop = asyncio.get_running_loop()
            seen.contexts.append(ctx)
            if seen.gate is None:
                seen.gate = asyncio.Event()
        if payload.action == "gate":
            await asyncio.wait_for(seen.gate.wait(), timeout=20)
        elif payload.action == "retry-after-once" and ctx.attempt == 1:
            raise RetryAfter(0.05)
        elif payload.action == "orm-twice":
            first = await sync_to_async(_backend)()
            await asyncio.to_thread(seen.meet.wait)  # both jobs are in flight at once
            second = await sync_to_async(_backend)()
            seen.orm[ctx.job_id] = [first, second]
        elif payload.action == "bound":
            seen.rows.append(await sync_to_async(_row)(payload.run_id))
            if ctx.attempt == 1:
                raise ConnectionError("smtp down")
        elif payload.action == "leave-transaction-open":
            await sync_to_async(lambda: connection.set_autocommit(False))()
        elif payload.action == "orm":
            return await sync_to_async(_backend)()
        return "done"

    return handle


def registry(seen: Seen, **policy) -> Registry:
    options = {"timeout": timedelta(seconds=10), "max_attempts": 2, "backoff": FAST_BACKOFF}
    return Registry([JobType(Act, handler(seen), Policy(**{**options, **policy}))])


def state(job) -> tuple[str, int, str]:
    row = Job.objects.get(pk=job.id)
    return row.state, row.attempts, row.last_error


@pytest.fixture
def seen():
    return Seen()


def test_fifty_async_jobs_awaiting_hold_no_handler_thread(seen):
    jobs = [enqueue(Act(action="gate")) for _ in range(50)]
    worker = Worker(registry(seen), worker_config(concurrency=50))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: seen.started == 50, timeout=20, interval=0.01)
        time.sleep(0.1)
        assert worker.executor.pool.busy == 0, "every async job awaits on the loop, no thread waits"
        assert worker.slots.in_flight == 50, "each still holds its slot"
        seen.loop.call_soon_threadsafe(seen.gate.set)
        wait_for(lambda: all(state(j)[0] == "succeeded" for j in jobs), timeout=20, interval=0.01)
    finally:
        worker.request_stop()
        thread.join(15)


def test_a_bound_async_job_type_marks_its_run_rows(seen):
    row = Delivery.objects.create(job_id="async-d-1")
    job = enqueue(Act(action="bound", run_id=row.pk))

    run_jobs(registry(seen, run_model=Delivery, run_field="run_id"), job.id)

    row.refresh_from_db()
    assert seen.rows == [("running", 1), ("running", 2)]
    assert (row.state, row.attempts, row.last_error) == ("succeeded", 2, "")
    assert state(job) == ("succeeded", 2, "")


def test_a_short_retry_after_is_waited_out_on_the_loop_and_the_attempt_recorded(seen):
    job = enqueue(Act(action="retry-after-once"))

    run_jobs(registry(seen), job.id)

    first, second = seen.contexts
    assert first is second, "same claim, same context: the queue was not involved"
    assert second.attempt == 2
    assert state(job) == ("succeeded", 2, "")


def test_a_transaction_left_open_is_caught_and_the_thread_gets_a_fresh_connection(seen):
    left = enqueue(Act(action="leave-transaction-open"))
    after = enqueue(Act(action="orm"))

    run_jobs(registry(seen, max_attempts=1), left.id, after.id, concurrency=1)

    assert state(left)[:1] + state(left)[2:] == ("failed", "handler_error")
    assert "left a transaction open" in Job.objects.get(pk=left.id).error_detail
    assert state(after)[0] == "succeeded"


def test_orm_calls_of_two_concurrent_async_jobs_run_on_their_own_threads(seen):
    jobs = [enqueue(Act(action="orm-twice")) for _ in range(2)]

    run_jobs(registry(seen), *(j.id for j in jobs), concurrency=2)

    assert {state(j)[0] for j in jobs} == {"succeeded"}
    one, two = seen.orm.values()
    # Each job's calls share one handler thread and its connection; the two jobs do not.
    assert one[0] == one[1] and two[0] == two[1]
    assert one[0]["thread"] != two[0]["thread"] and one[0]["pid"] != two[0]["pid"]
    assert all(c["thread"].startswith("jobs-handler-") for c in one + two)


def test_a_bug_in_the_loop_dispatch_leaks_no_slot(seen, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(executor, "execute_on_loop", broken)
    jobs = [enqueue(Act()) for _ in range(3)]

    worker = run_jobs(registry(seen, max_attempts=1), *(j.id for j in jobs), concurrency=2)

    assert {state(j)[0] for j in jobs} == {"failed"}
    assert "the worker failed running the job" in Job.objects.get(pk=jobs[0].id).error_detail
    assert worker.idle and worker.slots.in_flight == 0


def test_an_async_job_awaits_its_handler_without_asyncio_wait(seen, monkeypatch):
    """``asyncio.wait`` (a future and a callback per task, in Python) cost each async job
    about 5 µs of the worker's CPU; the job awaits its handler's task itself."""
    waits = []
    real_wait = asyncio.wait

    async def counted(*args, **kwargs):
        waits.append(args)
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr(asyncio, "wait", counted)
    jobs = [enqueue(Act()) for _ in range(5)]

    run_jobs(registry(seen), *(j.id for j in jobs))

    assert {state(j)[0] for j in jobs} == {"succeeded"} and seen.started == 5
    assert waits == []


def test_the_job_task_cancelled_under_its_handler_is_the_workers_failure_not_a_retry(seen):
    """The worker's own task for an async job, cancelled while the handler awaits (the loop
    closing under it), ends in the worker's failure, as before: not in the handler's
    cancellation, which a direct await would otherwise report as the handler's error."""
    job = enqueue(Act(action="gate"))
    worker = Worker(registry(seen, max_attempts=1), worker_config())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: seen.started == 1, interval=0.01)
        loop = seen.loop
        assert loop is not None

        def cancel_the_jobs_task() -> None:
            [task] = [t for t in asyncio.all_tasks(loop) if t.get_name().startswith("worker of")]
            task.cancel()

        loop.call_soon_threadsafe(cancel_the_jobs_task)
        wait_for(lambda: Job.objects.get(pk=job.id).state == "failed", interval=0.01)
    finally:
        worker.request_stop()
        thread.join(15)
    detail = Job.objects.get(pk=job.id).error_detail
    assert "the worker failed running the job: CancelledError" in detail, detail


def test_a_job_task_cancelled_before_its_first_step_gives_its_slot_back(seen, monkeypatch):
    """The loop's close cancels every task on it, the worker's own job tasks too: one that had
    not started yet never ran its ``finally`` and held its slot (and the job) for good."""
    start_tasks = Executor._start_tasks

    def cancelled_at_once(self, batch):
        start_tasks(self, batch)
        for task in asyncio.all_tasks(asyncio.get_running_loop()):
            if task.get_name().startswith("worker of"):
                task.cancel()  # before its first step: its coroutine never runs

    monkeypatch.setattr(Executor, "_start_tasks", cancelled_at_once)
    job = enqueue(Act())

    worker = run_jobs(registry(seen, max_attempts=1), job.id)

    assert worker.idle and worker.slots.in_flight == 0 and worker.handlers_running == 0
    assert seen.started == 0
    assert state(job)[0] == "failed", state(job)
    assert (
        "the worker failed running the job: CancelledError"
        in Job.objects.get(pk=job.id).error_detail
    )
