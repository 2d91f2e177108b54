"""The executor: runs the jobs a pass claimed, each to one outcome, which it queues with the
completer.

Sync handlers run on the handler pool's threads (:func:`jobs.worker.execution.execute`), async
ones as tasks on the worker's event loop (:func:`jobs.worker.on_loop.execute_on_loop`, handed
over in one call a batch); both decide their outcome by the same table
(:mod:`jobs.worker.execution`). A job starts only where a slot is free
(:meth:`jobs.worker.slots.Slots.take`), else it waits for one and the next handler to end
starts it (:meth:`Executor.finished`). Whatever happens on either path, a bug of ours
included, the job ends in :meth:`Executor.finished`: its slot is freed and its outcome (None:
nothing to write) queued. Each pass wakes only as many sleeping threads as its jobs need
(:mod:`jobs.worker.handoff`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

from jobs.catalogue.registry import Registry
from jobs.queue import ClaimedJob, Outcome
from jobs.runs import ErrorCode
from jobs.worker import metrics
from jobs.worker.completer import Completer
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, execute, failure_outcome, make_context
from jobs.worker.handoff import CpuSampler, threads_to_wake
from jobs.worker.leases import with_last_report
from jobs.worker.on_loop import execute_on_loop
from jobs.worker.pool import HandlerPool
from jobs.worker.slots import Slots

logger = logging.getLogger("jobs.worker")


class Executor:
    """Runs claimed jobs on the handler pool and the event loop (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        config: WorkerConfig,
        slots: Slots,
        completer: Completer,
        *,
        stopping: threading.Event,
        wake: threading.Event,
    ) -> None:
        self.registry = registry
        self.config = config
        self.pool: HandlerPool | None = None  # the run loop's, while it runs
        self._slots = slots
        self._completer = completer
        self._stopping = stopping
        self._wake = wake
        self._cpu = CpuSampler()
        self._resuming = threading.local()  # jobs _resume starts on this thread, in turn

    def dispatch(self, claimed: list[ClaimedJob], *, leased_at: float) -> None:
        """Hold the claimed jobs and start them where their kind runs."""
        if not claimed:
            return
        on_loop: list[Running] = []
        on_threads: list[Callable[[], None]] = []
        dispatched = []
        for job in claimed:
            job_type = self.registry[job.name]
            ctx = make_context(job, job_type, using=self.config.database)
            running = Running(job, job_type, ctx, leased_at=leased_at)
            dispatched.append(running)
            metrics.for_type(job.name).queue_latency.observe(job.latency)
            if job_type.is_async:
                on_loop.append(running)
            else:
                on_threads.append(partial(self.run_on_thread, running))
        held_run = self._slots.hold(dispatched)
        for name, count in Counter(job.name for job in claimed).items():
            metrics.for_type(name).claimed.inc(count)
        if on_threads:
            assert self.pool is not None  # dispatch follows a claim, in the running loop
            self.pool.submit_many(on_threads, wake=threads_to_wake(len(on_threads), held_run))
        if on_loop:
            self._to_loop(on_loop)

    # -- on a handler thread ---------------------------------------------------------------

    def run_on_thread(self, running: Running) -> None:
        """Runs on a handler thread. Whatever happens in it, the slot is freed."""
        slots = self._slots
        with slots.lock:
            # Not when a drain released the job before this thread took it, nor while async
            # handlers hold the slots this thread would take (it then waits in the slots'
            # waiting line); a job resumed from there holds its slot already.
            if running.handed_back or not (running.started or slots.take(running)):
                return
        outcome: Outcome | None = None
        began = time.monotonic()
        pool = self.pool
        task = pool.tasks_started() if pool is not None else 0
        cpu_began = self._cpu.begin(task, began)
        try:
            outcome = execute(
                running, shutting_down=self._stopping.is_set, lease=self.config.lease_duration
            )
        except BaseException as exc:  # a bug of ours must not leak the slot
            logger.exception("worker error running job %s", running.job.job_id)
            outcome = worker_failure(running, exc)
        finally:
            ran, held = self._cpu.end(task, cpu_began, began, time.monotonic())
            self.finished(running, outcome, ran=ran, held=held)

    # -- on the event loop -----------------------------------------------------------------

    def _to_loop(self, batch: list[Running]) -> None:
        """Async jobs go to the event loop in one hand-off a batch, not one a job."""
        try:
            self._loop().call_soon_threadsafe(self._start_tasks, batch)
        except BaseException as exc:  # the loop is gone: a bug of ours, never a leaked slot
            logger.exception("could not hand %d async jobs to the event loop", len(batch))
            for running in batch:
                self.finished(running, worker_failure(running, exc))

    def _loop(self) -> asyncio.AbstractEventLoop:
        pool = self.pool
        if pool is None:
            raise RuntimeError("the worker's handler pool is not running")
        return pool.event_loop.loop

    def _start_tasks(self, batch: list[Running]) -> None:
        """On the loop thread: one task per job a drain has not handed back meanwhile."""
        for running in batch:
            with self._slots.lock:
                # A job resumed from the waiting line holds its slot already.
                if running.handed_back or not (running.started or self._slots.take(running)):
                    continue
            try:
                task = self._loop().create_task(
                    self.run_on_loop(running), name=f"worker of job {running.job.job_id}"
                )
                task.add_done_callback(partial(self._never_started, running))
            except BaseException as exc:
                logger.exception("worker error starting job %s", running.job.job_id)
                self.finished(running, worker_failure(running, exc))

    def _never_started(self, running: Running, task: asyncio.Task[None]) -> None:
        """A job's task cancelled before its first step (the loop's close cancels every task
        on it) never ran the ``finally`` that frees its slot: freed here instead."""
        if task.cancelled() and not running.finished:
            self.finished(running, worker_failure(running, asyncio.CancelledError()))

    async def run_on_loop(self, running: Running) -> None:
        """An async job's task. Whatever happens in it, the slot is freed."""
        outcome: Outcome | None = None
        began = time.monotonic()
        try:
            assert self.pool is not None  # a task runs on the pool's loop
            outcome = await execute_on_loop(
                running,
                self.pool,
                shutting_down=self._stopping.is_set,
                lease=self.config.lease_duration,
            )
        except BaseException as exc:  # a bug of ours, or the loop closing under the job
            if not running.lost:  # else abandoned at exit: the loop's close cancelled it
                logger.exception("worker error running job %s", running.job.job_id)
            outcome = worker_failure(running, exc)
        finally:
            self.finished(running, outcome, ran=time.monotonic() - began)

    # -- the end of a handler --------------------------------------------------------------

    def finished(
        self,
        running: Running,
        outcome: Outcome | None,
        *,
        ran: float | None = None,
        held: float | None = None,
    ) -> None:
        """Free the job's slot, start a job that waited for one, and queue the outcome;
        ``ran``: the handler's time, ``held``: how long a thread-run one counts as holding
        its thread (:func:`jobs.worker.handoff.thread_held`; None: not measured)."""
        if outcome is not None:  # the last progress report goes with the outcome
            outcome = with_last_report(running, outcome)
        slots = self._slots
        with slots.lock:
            slots.times.add(ran, held)
            resumed = slots.end(running)
            wake = self._completer.add(running, outcome)
        if resumed is not None:
            self._resume(resumed)
        if wake:
            self._wake.set()

    def _resume(self, running: Running) -> None:
        """Start a job that waited for a slot, where its kind runs.

        An async job the loop cannot take (it is gone: a bug of ours) ends at once, and its
        end resumes the next waiting job: those are started here in turn, not by recursion.
        """
        resuming = self._resuming
        if getattr(resuming, "pending", None) is not None:
            resuming.pending.append(running)
            return
        resuming.pending = [running]
        try:
            while resuming.pending:
                job = resuming.pending.pop(0)
                if job.job_type.is_async:
                    self._to_loop([job])
                else:
                    assert self.pool is not None  # a job waits for a slot in the running loop
                    self.pool.submit(partial(self.run_on_thread, job))
        finally:
            resuming.pending = None


def worker_failure(running: Running, exc: BaseException) -> Outcome | None:
    """The outcome of a job the worker itself failed to run (None: it is no longer ours)."""
    if running.lost:
        return None
    return failure_outcome(
        running, ErrorCode.HANDLER_ERROR, f"the worker failed running the job: {exc!r}"
    )
