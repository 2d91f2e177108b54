"""One asyncio event loop per worker, on its own thread, for ``async def`` handlers.

Why: ``asyncio.run`` per call built and tore down a loop for every job (a selector, a socket
pair, the shutdown of async generators and of the default executor), and nothing could
outlive a job on it (a client's connection pool, a cache). With 100 handlers in flight that
cost 400-500 µs of CPU a call, against 140-190 µs through the shared loop. The handler pool
starts one :class:`HandlerLoop` with its threads and closes it after them.

How an async job maps onto the worker's accounting: it holds one slot from claim to outcome
but, dispatched by the run loop, no thread while it awaits (:mod:`jobs.worker.on_loop`); its
synchronous steps, the ORM's thread-sensitive ``sync_to_async`` calls among them, run on one
handler thread it borrows (:mod:`jobs.worker.job_thread`), whose connection the pool keeps,
checks and closes as for sync handlers. The loop thread itself opens no database connection
(Django refuses synchronous ORM calls there). :func:`run_async` (a thread waiting for the
coroutine through asgiref's ``async_to_sync`` pointed at this loop, :meth:`HandlerLoop.bind`)
remains for async handlers called outside that dispatch.

Cancellation: the context of an async job carries a :class:`CancelEvent`. Setting it (the
deadline passed, the lease was lost, a drain cancels) also cancels the job's task, so
``asyncio.CancelledError`` is raised at the await the handler is in; the outcome is decided as
for a sync handler told to stop (``deadline_exceeded``, nothing written, handed back).

A handler that blocks the loop (``time.sleep``, synchronous I/O, ORM without
``sync_to_async`` inside ``async def``) stalls every async handler of the worker: a watcher
thread logs a warning with the loop thread's stack when the loop has not run for
:data:`BLOCKED_AFTER` seconds. It says what held the loop: code on it, the GIL kept by other
threads, or nothing in the worker at all, when the watcher itself did not run either and the
process used no CPU meanwhile (SIGSTOP, a paused host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from asgiref.sync import AsyncToSync, SyncToAsync

if TYPE_CHECKING:
    from jobs.core.context import JobContext

logger = logging.getLogger("jobs.worker")

#: Seconds without a turn of the loop after which the watcher warns that it is blocked.
BLOCKED_AFTER = 1.0
#: How often the loop stamps that it runs, and the watcher looks (seconds).
_BEAT = 0.25


class CancelEvent(threading.Event):
    """``JobContext.cancelled`` of an async job: setting it also cancels the job's task."""

    def __init__(self) -> None:
        super().__init__()
        self._hook_lock = threading.Lock()
        self._hook: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        with self._hook_lock:
            hook = self._hook
        if hook is not None:
            hook()

    def on_set(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook`` when the event is set (at once if it is set already); None removes it."""
        with self._hook_lock:
            self._hook = hook
        if hook is not None and self.is_set():
            hook()


def cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` from any thread; never raises (the lease keeper calls this)."""
    try:
        loop.call_soon_threadsafe(task.cancel)
    except Exception:  # the loop is closed: the task is gone with it
        logger.debug("could not cancel task %r: its loop is closed", task, exc_info=True)


async def _run_handler(handler: Callable[..., Any], payload: object, ctx: JobContext) -> Any:
    task = asyncio.current_task()
    assert task is not None  # asgiref runs this as a task
    task.set_name(f"job {ctx.job_id} ({ctx.name})")
    cancelled = ctx.cancelled
    if isinstance(cancelled, CancelEvent):
        cancelled.on_set(partial(cancel_soon, asyncio.get_running_loop(), task))
    try:
        return await handler(payload, ctx)
    finally:
        if isinstance(cancelled, CancelEvent):
            cancelled.on_set(None)


# A BaseException the coroutine raises (KeyboardInterrupt, SystemExit, CancelledError) ends
# its task normally (asgiref's wrapper catches it) and is raised again on the waiting thread,
# so it becomes the job's outcome and never reaches the loop.
_call_on_loop = AsyncToSync(_run_handler)


def run_async(handler: Callable[..., Any], payload: object, ctx: JobContext) -> Any:
    """Run an ``async def`` handler to the end from a handler thread; raises what it raised.

    On a thread bound to a running :class:`HandlerLoop` the coroutine runs there; elsewhere
    asgiref runs it on a new loop of its own, as ``async_to_sync`` always does.
    """
    return _call_on_loop(handler, payload, ctx)


class HandlerLoop:
    """The loop thread, its watcher, and the orderly close that leaves no task pending."""

    def __init__(self, name: str = "jobs-handler-loop", blocked_after: float = BLOCKED_AFTER):
        self._name = name
        self._blocked_after = blocked_after
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._shut_down = False  # set by _shutdown just before it stops the loop
        self._stop_watching = threading.Event()
        self._beat = time.monotonic()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started on first use)."""
        return self.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self) -> asyncio.AbstractEventLoop:
        """Start the loop thread and its watcher once; returns the loop."""
        with self._lock:
            if self._loop is not None:
                return self._loop
            loop = self._loop = asyncio.new_event_loop()
            ready = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(loop, ready), name=self._name, daemon=True
            )
            self._thread.start()
            ready.wait()
            threading.Thread(target=self._watch, name=f"{self._name}-watch", daemon=True).start()
            return loop

    def bind(self) -> None:
        """Make ``async_to_sync`` on the calling thread run coroutines on this loop.

        asgiref looks for the loop in ``SyncToAsync.threadlocal``, where its own
        ``sync_to_async`` threads record the loop that started them; a handler thread is, in
        the same way, a thread working for this loop. Besides async handlers this covers
        ``async_to_sync`` in sync handlers (how Django runs ``async def`` tasks).
        """
        local = SyncToAsync.threadlocal
        local.main_event_loop = self.loop
        local.main_event_loop_pid = os.getpid()

    def close(self, timeout: float) -> bool:
        """Cancel the tasks left on the loop, wait up to ``timeout`` for them, stop and close.

        True once the loop is closed. Tasks that ignore their cancellation past the timeout
        keep the loop running (on its daemon thread) until they end; closing it under them
        would destroy them pending.
        """
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._closing:
                return thread is None or not thread.is_alive()
            self._closing = True
        self._stop_watching.set()
        if not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._shutdown(timeout), loop)
        thread.join(timeout + 0.5)
        return not thread.is_alive()

    # -- the loop thread ---------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.call_soon(self._stamp)
        try:
            while True:
                try:
                    loop.run_forever()
                except BaseException:  # a stray task's KeyboardInterrupt/SystemExit
                    logger.exception("a task on the handlers' event loop raised; carrying on")
                    continue
                if self._shut_down:
                    break
                # Stopped by a handler (loop.stop()): the other handlers still need it.
        finally:
            loop.close()
            asyncio.set_event_loop(None)

    def _stamp(self) -> None:
        self._beat = time.monotonic()
        if not self._closing:
            asyncio.get_running_loop().call_later(_BEAT, self._stamp)

    async def _shutdown(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        left = [task for task in asyncio.all_tasks() if task is not me]
        if left:
            logger.warning(
                "cancelling %d tasks left on the handlers' event loop at shutdown: %s",
                len(left),
                ", ".join(sorted(_task_name(task) for task in left)[:10]),
                extra={"action": "loop_tasks_cancelled"},
            )
            for task in left:
                task.cancel()
            _, pending = await asyncio.wait(left, timeout=timeout)
            if pending:
                logger.error(
                    "%d tasks on the handlers' event loop ignore their cancellation; the loop "
                    "closes when they end: %s",
                    len(pending),
                    ", ".join(sorted(_task_name(task) for task in pending)[:10]),
                    extra={"action": "loop_tasks_stuck"},
                )
                await asyncio.wait(pending)
            for task in left:  # retrieved, so that asyncio does not log them as unretrieved
                if not task.cancelled():
                    task.exception()
        await loop.shutdown_asyncgens()
        with contextlib.suppress(Exception):  # run_in_executor(None, …) calls still running
            await asyncio.wait_for(loop.shutdown_default_executor(), timeout)
        self._shut_down = True
        loop.stop()

    # -- the watcher thread ------------------------------------------------------------------

    def _watch(self) -> None:
        warned_for = None
        looked, cpu = time.monotonic(), time.process_time()
        while not self._stop_watching.wait(_BEAT):
            # The watcher's own gap since its last look, and the CPU the process used in it:
            # a gap seen by this thread too means no thread ran, whatever the loop was doing.
            now, now_cpu = time.monotonic(), time.process_time()
            gap, used = now - looked, now_cpu - cpu
            looked, cpu = now, now_cpu
            beat = self._beat
            if gap - _BEAT >= self._blocked_after:
                warned_for = beat  # this stall is reported here, whether or not the loop ran
                self._warn_held(gap, used)
                continue
            blocked = now - beat
            if blocked < self._blocked_after or warned_for == beat:
                continue
            warned_for = beat  # once per stall
            self._warn_blocked(blocked)

    def _warn_held(self, gap: float, used: float) -> None:
        """No thread of the process ran for ``gap`` seconds, the watcher included.

        Either one thread kept the GIL through a long call into C code, and the process
        burnt CPU all along; or the process itself did not run (SIGSTOP, a paused host or
        VM, a CPU quota used up), and used almost none. The loop is not to blame either way.
        The line between them is a tenth of the gap, not half: on a host loaded several times
        over, a thread keeping the GIL gets only its share of a core, a fifth or a quarter of
        the gap, while a stopped process uses nothing at all.
        """
        if used < gap / 10:
            cause = "stopped"
            why = (
                f"the whole process was stopped or starved of CPU (SIGSTOP, a paused host or "
                f"VM, an overloaded host or a CPU quota), not the loop alone: no thread of this "
                f"worker ran, and it used {used:.1f}s of CPU in that time"
            )
        else:
            cause = "gil"
            why = (
                "it waits for the GIL, which one thread of this worker kept through a long call "
                "into C code: no other thread ran either"
            )
        self._log(gap, cause, why, ".")

    def _warn_blocked(self, blocked: float) -> None:
        """The loop has not run while the watcher did: code on it blocks, or the GIL is busy."""
        thread = self._thread
        frame = sys._current_frames().get(thread.ident) if thread and thread.ident else None
        if frame is not None and frame.f_code.co_filename.endswith("selectors.py"):
            cause = "gil"
            why = (
                "it waits for the GIL, which other threads of this worker hold (CPU-bound handlers)"
            )
        else:
            cause = "blocking_code"
            why = "code on it blocks (time.sleep, synchronous I/O or ORM calls inside async def)"
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame else "(no stack)\n"
        self._log(
            blocked,
            cause,
            why,
            "; every async handler of this worker waits meanwhile. The loop thread is at:\n"
            + stack.rstrip(),
        )

    def _log(self, blocked: float, cause: str, why: str, tail: str) -> None:
        """One warning a stall; ``cause`` (stopped, gil, blocking_code) is in its record."""
        logger.warning(
            "the handlers' event loop has not run for %.1fs: %s%s",
            blocked,
            why,
            tail,
            extra={"action": "loop_blocked", "blocked": round(blocked, 3), "cause": cause},
        )


def _task_name(task: asyncio.Task[Any]) -> str:
    qualname = getattr(task.get_coro(), "__qualname__", "?")
    return f"{task.get_name()} ({qualname})"
