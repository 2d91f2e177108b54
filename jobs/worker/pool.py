"""A fixed pool of handler threads, each with its own database connection.

Django connections are per thread. Around every job the pool does what Django's request cycle
does (``close_old_connections``), so ``CONN_MAX_AGE`` and health checks apply to handlers too,
and each thread closes its connections when it exits.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
from collections.abc import Callable

from django.db import close_old_connections, connections

logger = logging.getLogger("jobs.worker")

_STOP = object()


class HandlerPool:
    def __init__(self, size: int, name: str = "jobs-handler") -> None:
        self._tasks: stdlib_queue.SimpleQueue = stdlib_queue.SimpleQueue()
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
        deadline = threading.Event()
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                deadline.set()
        return not deadline.is_set()

    def _loop(self) -> None:
        try:
            while (task := self._tasks.get()) is not _STOP:
                close_old_connections()
                try:
                    task()
                except Exception:  # a bug in the worker itself; the job's lease will expire
                    logger.exception("handler task crashed")
                finally:
                    close_old_connections()
        finally:
            connections.close_all()
