"""Releasing the jobs that wait for ones this worker ended, on a thread of its own.

When a job others wait for ends, the statement that ended it only records a settlement
(:mod:`jobs.queue.dependencies`); the waiting jobs are released after it, in bounded steps.
The run loop wakes this thread as soon as a pass ends such a job, so they are due at once;
it also looks every ``interval`` seconds, for jobs ended elsewhere (an operator's cancel, the
lease sweep, a handler's ``jobs.complete``). Releasing a large fan-out takes a while; on
this thread it holds up neither claims nor outcomes. Any number of workers may release at
once: each takes a different settlement.
"""

from __future__ import annotations

import logging
import threading

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.db import bounds as dbbounds
from jobs.db.sqlstate import one_line
from jobs.queue import dependencies

logger = logging.getLogger("jobs.worker")


class DependentsRelease:
    def __init__(self, *, interval: float = 1.0, using: str = DEFAULT_DB_ALIAS) -> None:
        self.interval = interval
        self.using = using
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._loop, name="jobs-release", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wake(self) -> None:
        """Look now: a pass ended a job others wait for."""
        self._wake.set()

    def run_once(self) -> int:
        """Release what is pending, for a while at most; the waiting jobs settled."""
        return dependencies.release_pending(using=self.using)

    def _loop(self) -> None:
        with dbbounds.bounded(self.using):
            try:
                while not self._stop.is_set():
                    self._wake.wait(self.interval)
                    self._wake.clear()
                    if self._stop.is_set():
                        break
                    if self._release():
                        self._wake.set()  # more may be pending: go on at once
            finally:
                connections[self.using].close()

    def _release(self) -> bool:
        """One run; True when it settled something (there may be more)."""
        try:
            settled = self.run_once()
        except Exception as exc:  # a lock or statement timeout, an outage: try again later
            if not self._failing:
                logger.warning(
                    "could not release jobs waiting for others (%s); trying again",
                    one_line(exc),
                    extra={"action": "release_failed"},
                )
            self._failing = True
            return False
        self._failing = False
        if settled:
            logger.debug("released %d waiting jobs", settled, extra={"action": "released"})
        return settled > 0
