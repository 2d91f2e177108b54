"""Run an ``async def`` job as a task on the worker's event loop, holding no thread.

Why: a handler thread waiting for each coroutine (``async_to_sync``) cost 175-190 µs of CPU a
job with 100 in flight, against 25 µs for a thread in ``time.sleep``; the run loop now hands
claimed async jobs to the loop in one call a batch, and each ends in the same outcome as
:func:`jobs.worker.execution.execute` decides (it shares :func:`~jobs.worker.execution.judge`).

The job's synchronous steps (run-row marking, the next attempt, the open-transaction check,
the handler's thread-sensitive ``sync_to_async`` calls) run on one handler thread the job
borrows for them (:class:`jobs.worker.job_thread.JobThread`). Cancellation (deadline, lost
lease, drain) cancels the task of the step the job awaits: the handler call or the
in-process RetryAfter wait, never the worker's own steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from functools import partial
from typing import Any

from asgiref.sync import ThreadSensitiveContext

from jobs.queue import Outcome
from jobs.worker import metrics
from jobs.worker.event_loop import CancelEvent, cancel_soon
from jobs.worker.execution import (
    Running,
    WaitAndRetry,
    close_open_transactions,
    count_next_attempt,
    decode,
    judge,
    mark_running,
    sync_completed,
)
from jobs.worker.job_thread import JobThread
from jobs.worker.pool import HandlerPool

_Called = tuple[BaseException | None, Any, float]


class _Current:
    """The task the job awaits now, which its context's ``cancelled`` cancels."""

    def __init__(self, running: Running) -> None:
        self.ctx = running.ctx
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task[Any] | None = None

    def cancel(self) -> None:  # any thread
        task = self.task
        if task is not None:
            cancel_soon(self.loop, task)

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = self.task = self.loop.create_task(coro, name=name)
        # Set after the hook read the previous task: this one is cancelled here instead.
        if self.ctx.cancelled.is_set():
            task.cancel()
        return task


async def _guarded(
    handler: Callable[..., Coroutine[Any, Any, Any]], payload: object, ctx: object
) -> tuple[BaseException | None, Any]:
    """Whatever the handler raises (KeyboardInterrupt too) is the job's, not the loop's."""
    try:
        return None, await handler(payload, ctx)
    except BaseException as exc:
        return exc, None


async def _call(current: _Current, running: Running, payload: object, name: str) -> _Called:
    """Call the handler in a task of its own, the one its cancellation cancels.

    The handler's task is awaited directly: through ``asyncio.wait`` (a future and a done
    callback a task, in Python) a job cost about 5 µs more of the worker's CPU. Awaited so,
    a cancellation of this job's own task (the loop closing under it) is passed on to the
    handler's task, whose ``_guarded`` returns it as the handler's error; it is raised here
    again instead, as when this task awaited a wait, so the job ends as the worker's failure.
    """
    started = time.monotonic()
    task = current.start(_guarded(running.job_type.handler, payload, running.ctx), name)
    try:
        error, result = await task
    except asyncio.CancelledError:
        if not task.cancelled():  # this job's task was cancelled after the handler's ended
            raise
        error, result = asyncio.CancelledError(), None  # before _guarded's first step
    own = asyncio.current_task()
    if own is not None and own.cancelling():
        raise asyncio.CancelledError
    return error, result, time.monotonic() - started


async def execute_on_loop(
    running: Running,
    pool: HandlerPool,
    *,
    shutting_down: Callable[[], bool],
    lease: timedelta | None = None,
) -> Outcome | None:
    """:func:`jobs.worker.execution.execute` for an ``async def`` handler, on the loop."""
    decoded = decode(running)
    if isinstance(decoded, Outcome):
        return decoded
    job, job_type, ctx = running.job, running.job_type, running.ctx
    loop = asyncio.get_running_loop()
    thread = JobThread(pool)
    current = _Current(running)
    cancelled = ctx.cancelled
    if isinstance(cancelled, CancelEvent):
        cancelled.on_set(current.cancel)
    name = f"job {job.job_id} ({job.name})"
    try:
        # Thread-sensitive sync_to_async calls of the handler (and of tasks it starts and
        # awaits) go to the job's thread.
        async with ThreadSensitiveContext(executor=thread):
            while True:
                if running.lost:  # given up while it was held (or between attempts)
                    return None
                if job_type.policy.run_model is not None:
                    await loop.run_in_executor(thread, mark_running, running)
                error, result, duration = await _call(current, running, decoded.payload, name)
                metrics.for_type(job.name).handler_duration.observe(duration)
                left_open: list[str] = []
                if thread.borrowed:  # else the handler ran nothing on a handler thread
                    left_open = await loop.run_in_executor(
                        thread, partial(close_open_transactions, failed=error is not None)
                    )
                verdict = judge(running, error, result, duration, left_open)
                if running.completed and job_type.policy.run_model is not None:
                    await loop.run_in_executor(thread, sync_completed, running)
                if not isinstance(verdict, WaitAndRetry):
                    return verdict
                interrupted = await _wait_in_process(running, current, verdict.delay, name)
                if running.lost:
                    return None
                if not (interrupted or shutting_down()):
                    attempt = await loop.run_in_executor(
                        thread, partial(count_next_attempt, running, lease, verdict.otherwise)
                    )
                    if attempt is None:  # lost, or asked to stop
                        return Outcome.cancelled(job) if running.cancel_requested else None
                    if attempt:
                        continue
                return verdict.otherwise
    finally:
        if isinstance(cancelled, CancelEvent):
            cancelled.on_set(None)
        thread.shutdown()


async def _wait_in_process(running: Running, current: _Current, delay: float, name: str) -> bool:
    """Sleep out a short Retry-After on the loop, keeping the lease; True when interrupted."""
    ctx = running.ctx
    # The next attempt's clock starts after the wait: no deadline passes while waiting.
    ctx.started = time.monotonic() + delay
    wait = current.start(asyncio.sleep(delay), f"{name} waits to retry")
    await asyncio.wait([wait])
    return wait.cancelled() or ctx.cancelled.is_set()
