"""A fixed pool of handler threads, each with its own database connection.

Django connections are per thread. A handler thread keeps its connection between jobs for up
to ``JOBS["HANDLER_CONN_MAX_AGE"]`` (a worker is one long "request", and a new connection per
job would cost more than most jobs), but closes it after a job that left it broken or inside
a transaction, and closes every connection when the thread exits. A maximum age of 0 closes
after every job, like Django's request cycle with ``CONN_MAX_AGE = 0``.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable

from django.db import connections

from jobs.conf import jobs_settings

logger = logging.getLogger("jobs.worker")

_STOP = object()


class HandlerPool:
    def __init__(self, size: int, name: str = "jobs-handler") -> None:
        self._tasks: stdlib_queue.SimpleQueue = stdlib_queue.SimpleQueue()
        self._max_age = jobs_settings.HANDLER_CONN_MAX_AGE.total_seconds()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def shutdown(self, timeout: float) -> bool:
        """Ask threads to exit after their current task; True if all did within ``timeout``."""
        for _ in self._threads:
            self._tasks.put(_STOP)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _loop(self) -> None:
        opened: dict[str, tuple[int, float]] = {}
        try:
            while (task := self._tasks.get()) is not _STOP:
                try:
                    task()
                except Exception:  # a bug in the worker itself; the job's lease will expire
                    logger.exception("handler task crashed")
                finally:
                    self._recycle(opened)
        finally:
            connections.close_all()

    def _recycle(self, opened: dict[str, tuple[int, float]]) -> None:
        """After a job: keep healthy connections, close broken, dirty or old ones."""
        now = time.monotonic()
        for conn in connections.all(initialized_only=True):
            raw = conn.connection
            if raw is None:
                opened.pop(conn.alias, None)
                continue
            since = opened.get(conn.alias)
            if since is None or since[0] != id(raw):
                since = opened[conn.alias] = (id(raw), now)
            broken = conn.errors_occurred and not conn.is_usable()
            dirty = conn.in_atomic_block or not conn.get_autocommit()
            if broken or dirty or now - since[1] >= self._max_age:
                conn.close()
                opened.pop(conn.alias, None)
            else:
                conn.errors_occurred = False
