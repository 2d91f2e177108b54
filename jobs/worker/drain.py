"""Graceful drain: stop claiming, let handlers finish, cancel, hand back only what is safe.

A job is handed back only once no handler of this worker runs it: its handler returned after
being cancelled, or never started. A handler that ignores its cancellation past the cancel
timeout keeps its lease when the process exits, so no other worker runs the job until that
lease expires (``lease_expired``). The drain works through the worker's parts: the slots say
which jobs are held, started or running (:mod:`jobs.worker.slots`), the completer which
outcomes are still to write (:mod:`jobs.worker.completer`), and the run loop's pass writes
them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from jobs import queue
from jobs.worker import metrics
from jobs.worker.completer import Completer
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, run_rows
from jobs.worker.slots import Slots

logger = logging.getLogger("jobs.worker")

#: After a second stop signal, how long cancelled handlers still get to return (seconds).
FORCED_CANCEL_TIMEOUT = 1.0


class Drain:
    """The worker's drain (see the module docstring); :meth:`run` once, after the loop."""

    def __init__(
        self,
        config: WorkerConfig,
        slots: Slots,
        completer: Completer,
        *,
        loop_pass: Callable[[], None],
        wake: threading.Event,
        force: threading.Event,
    ) -> None:
        self.config = config
        self._slots = slots
        self._completer = completer
        self._pass = loop_pass
        self._wake = wake
        self._force = force

    def run(self) -> int:
        """Stop claiming, let handlers finish, then cancel and hand back what is left; 0."""
        # Prefetched jobs no thread has taken go back now, for other workers to start, not
        # after the wait: this worker would only start them to drain them.
        self._release(self._slots.take_unstarted())
        busy = self._slots.busy
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
        self._completer.flush_history(final=True)
        logger.info("worker stopped", extra={"action": "stopped"})
        return 0

    @property
    def _cancel_grace(self) -> float:
        """A second signal skips the shutdown wait and shortens this one to a second."""
        if self._force.is_set():
            return min(self.config.cancel_timeout, FORCED_CANCEL_TIMEOUT)
        return self.config.cancel_timeout

    def _flush_until(self, deadline: float, *, until_forced: bool = False) -> None:
        """Write outcomes as handlers finish, until none runs or the deadline passes.

        With ``until_forced``, a second stop signal also ends the wait.
        """
        while not (until_forced and self._force.is_set()):
            self._wake.clear()
            self._pass()
            # In this order: a handler's end queues its outcome in the step that frees its
            # slot, so with no job in flight every outcome is queued (or written by the pass
            # just run). Outcomes deferred because another session held their row are not
            # written yet either: leaving now would drop them and leave their leases to expire.
            if self._slots.busy == 0 and not self._completer.pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(remaining, max(self.config.ack_interval, 0.05)))

    def _cancel_leftovers(self) -> None:
        """Ask running handlers to stop; release jobs no handler thread has taken."""
        unstarted = self._slots.cancel_started()
        cancelled = self._slots.busy
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
        stuck = self._slots.abandon()
        if stuck:
            logger.error(
                "%d handlers did not stop after cancellation; their jobs keep their leases and "
                "run again after those expire (lease_expired): ids %s",
                len(stuck),
                [r.job.id for r in stuck],
                extra={"action": "abandoned"},
            )
        unwritten = self._completer.abandon()
        if unwritten:
            logger.error(
                "%d outcomes could not be written before exit (another session kept their rows "
                "locked); those jobs run again after their leases expire: ids %s",
                len(unwritten),
                [r.job.id for r, _ in unwritten],
                extra={"action": "abandoned"},
            )
