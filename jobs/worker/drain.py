"""Graceful drain: stop claiming, let handlers finish, cancel, hand back only what is safe.

A job is handed back only once no handler of this worker runs it: its handler returned after
being cancelled, or never started. A handler that ignores its cancellation past the cancel
timeout keeps its lease when the process exits, so no other worker runs the job until that
lease expires (``lease_expired``). Mixed into :class:`jobs.worker.runner.Worker`, whose state
(held jobs, the lock, the flags) it works on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from jobs import queue
from jobs.queue import Outcome
from jobs.worker import metrics
from jobs.worker.execution import Running, run_rows

if TYPE_CHECKING:
    import threading
    from collections import Counter
    from uuid import UUID

    from jobs.worker.config import WorkerConfig

logger = logging.getLogger("jobs.worker")

#: After a second stop signal, how long cancelled handlers still get to return (seconds).
FORCED_CANCEL_TIMEOUT = 1.0


class Draining:
    """The drain half of the worker (see the module docstring)."""

    if TYPE_CHECKING:
        # The Worker's state and loop pass that draining works on (jobs.worker.runner).
        config: WorkerConfig
        ready: bool
        _lock: threading.Lock
        _held: dict[tuple[int, UUID], Running]
        _in_flight: int
        _in_flight_by_name: Counter[str]
        _acks: list[tuple[Running, Outcome | None]]
        _deferred: list[tuple[Running, Outcome | None]]
        _wake: threading.Event
        _force: threading.Event

        def _pass(self) -> None: ...

        def _flush_history(self, now: float | None = None, *, final: bool = False) -> None: ...

    def _drain(self) -> int:
        """Stop claiming, let handlers finish, then cancel and hand back what is left.

        A job is handed back only once no handler of this worker runs it: its handler
        returned after being cancelled, or never started. A handler that ignores its
        cancellation past the cancel timeout keeps its lease when the process exits, so no
        other worker runs the job until that lease expires (``lease_expired``).
        """
        self.ready = False
        metrics.ready.set(0)
        # Prefetched jobs no thread has taken go back now, for other workers to start, not
        # after the wait: this worker would only start them to drain them.
        self._release(self._take_unstarted())
        busy = self._busy()
        if busy:
            logger.info(
                "draining: waiting up to %gs for %d running jobs",
                self.config.shutdown_timeout,
                busy,
                extra={"action": "drain"},
            )
        self._flush_until(time.monotonic() + self.config.shutdown_timeout, until_forced=True)
        self._cancel_leftovers()
        self._flush_until(time.monotonic() + self._cancel_grace)
        self._abandon_leftovers()
        self._flush_history(final=True)
        logger.info("worker stopped", extra={"action": "stopped"})
        return 0

    @property
    def _cancel_grace(self) -> float:
        """A second signal skips the shutdown wait and shortens this one to a second."""
        if self._force.is_set():
            return min(self.config.cancel_timeout, FORCED_CANCEL_TIMEOUT)
        return self.config.cancel_timeout

    def _busy(self) -> int:
        with self._lock:
            return self._in_flight

    def _flush_until(self, deadline: float, *, until_forced: bool = False) -> None:
        """Write outcomes as handlers finish, until none runs or the deadline passes.

        With ``until_forced``, a second stop signal also ends the wait.
        """
        while not (until_forced and self._force.is_set()):
            self._wake.clear()
            self._pass()
            with self._lock:
                # Outcomes deferred because another session held their row are not written
                # yet either: leaving now would drop them and leave their leases to expire.
                if self._in_flight == 0 and not self._acks and not self._deferred:
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(remaining, max(self.config.ack_interval, 0.05)))

    def _take_unstarted(self) -> list[Running]:
        with self._lock:
            return self._unhold_unstarted()

    def _unhold_unstarted(self) -> list[Running]:
        """Held jobs no handler has taken, no longer held (under ``self._lock``): a thread that
        takes one later finds it handed back and leaves it."""
        unstarted = [
            r
            for r in self._held.values()
            if not (r.finished or r.lost or r.started or r.handed_back)
        ]
        for running in unstarted:
            running.handed_back = True
            self._held.pop((running.job.id, running.job.claim_token), None)
            self._in_flight -= 1
            self._in_flight_by_name[running.job.name] -= 1
        return unstarted

    def _cancel_leftovers(self) -> None:
        """Ask running handlers to stop; release jobs no handler thread has taken."""
        with self._lock:
            for running in self._held.values():
                if running.started and not (running.finished or running.lost):
                    running.shutdown = True
                    running.ctx.cancelled.set()
            unstarted = self._unhold_unstarted()
        cancelled = self._busy()
        if cancelled:
            logger.warning(
                "cancelled %d running handlers; waiting up to %gs for them to return",
                cancelled,
                self._cancel_grace,
                extra={"action": "cancel"},
            )
        self._release(unstarted)

    def _release(self, handed: list[Running]) -> None:
        if not handed:
            return
        try:
            report = queue.release(
                [r.job for r in handed], runs=run_rows(handed), using=self.config.database
            )
        except Exception:
            logger.exception("could not release jobs at shutdown; their leases will expire")
            return
        for running in handed:
            metrics.released.labels(running.job.name).inc()
        logger.warning(
            "handed back %d unfinished jobs: ids %s",
            len(report.applied),
            list(report.applied),
            extra={"action": "released"},
        )

    def _abandon_leftovers(self) -> None:
        """Handlers still running at exit keep their leases: never release a running job."""
        with self._lock:
            stuck = [r for r in self._held.values() if not r.finished and not r.lost]
            for running in stuck:
                running.lost = True
        if stuck:
            logger.error(
                "%d handlers did not stop after cancellation; their jobs keep their leases and "
                "run again after those expire (lease_expired): ids %s",
                len(stuck),
                [r.job.id for r in stuck],
                extra={"action": "abandoned"},
            )
        with self._lock:
            unwritten, self._deferred = self._deferred, []
        if unwritten:
            logger.error(
                "%d outcomes could not be written before exit (another session kept their rows "
                "locked); those jobs run again after their leases expire: ids %s",
                len(unwritten),
                [r.job.id for r, _ in unwritten],
                extra={"action": "abandoned"},
            )
