"""One handler thread lent to an ``async def`` job for its synchronous steps.

An async job runs as a task on the worker's event loop and holds no thread while it awaits.
What needs a thread and its database connection (the worker's run-table and next-attempt
writes, the open-transaction check, the handler's thread-sensitive ``sync_to_async`` calls,
which is how Django's ORM runs under ``async def``) runs on one handler-pool thread the job
borrows on its first such step and keeps until it ends: every step of the job sees the same
connection, as when the job held its thread throughout, and the pool recycles that
connection after the job as after a sync one. Jobs in flight never outnumber the pool's
threads (one slot, one thread), so a borrowed thread is always free, or about to be.
"""

from __future__ import annotations

import queue as stdlib_queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobs.worker.pool import HandlerPool

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class JobThread(Executor):
    """An executor running one call at a time on one borrowed pool thread (see module doc).

    ``asgiref.sync.ThreadSensitiveContext(executor=…)`` takes it, so that thread-sensitive
    calls made in the job's context run here rather than on asgiref's process-wide thread.
    """

    def __init__(self, pool: HandlerPool) -> None:
        self._pool = pool
        self._calls: stdlib_queue.SimpleQueue[_Call | None] = stdlib_queue.SimpleQueue()
        self._lock = threading.Lock()
        self._borrowed = False
        self._closed = False

    @property
    def borrowed(self) -> bool:
        """True once a step ran (or waits to run) on a pool thread for this job."""
        return self._borrowed

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the job has ended: its thread is given back")
            self._calls.put((future, fn, args, kwargs))
            if not self._borrowed:
                self._borrowed = True
                self._pool.submit(self._serve)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Give the thread back once the calls already submitted have run (never blocks)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._borrowed:
                self._calls.put(None)

    def _serve(self) -> None:
        """Runs on the pool thread: the job's calls, in order, until the job ends."""
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # the caller's to judge, on the loop
                future.set_exception(exc)
            else:
                future.set_result(result)
