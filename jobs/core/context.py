"""What a handler is told about the attempt it runs."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS

from jobs.core.progress import Progress
from jobs.core.progress import report as checked_report
from jobs.errors import Cancelled


@dataclass(eq=False)
class JobContext:
    """Passed to every handler call, alongside its decoded payload.

    ``cancelled`` is set when the worker wants the handler to stop: its deadline passed, its
    lease was lost, or the worker is shutting down. Python cannot interrupt a thread, so
    long handlers should check it (:meth:`raise_if_cancelled`) or wait on it
    (:meth:`sleep`) between steps.
    """

    id: int
    job_id: str
    name: str
    tenant: str
    attempt: int
    max_attempts: int
    timeout: float
    logger: logging.LoggerAdapter[logging.Logger]
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    # The attempt's fencing token: a write made on the job's behalf (completing it in the
    # handler's own transaction) holds only while the row still carries it.
    claim_token: uuid.UUID | None = None
    # The database alias the worker runs the job's queue on.
    using: str = DEFAULT_DB_ALIAS
    # The latest progress report and how many were made, and how many of those the worker
    # has written (jobs.core.progress): a report waits in memory for the next lease renewal.
    _progress_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _progress: Progress | None = field(default=None, init=False, repr=False)
    _progress_made: int = field(default=0, init=False, repr=False)
    _progress_sent: int = field(default=0, init=False, repr=False)

    @property
    def final_attempt(self) -> bool:
        """True when a failure of this attempt will not be retried."""
        return self.attempt >= self.max_attempts

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` value after which the attempt counts as overrun."""
        return self.started + self.timeout

    def raise_if_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled(f"job {self.job_id} was cancelled by the worker")

    def sleep(self, seconds: float) -> bool:
        """Wait up to ``seconds``; returns True early if the job was cancelled meanwhile."""
        return self.cancelled.wait(seconds)

    def progress(self, done: int, total: int | None = None, note: str = "") -> None:
        """Report how far the handler got; cheap enough to call for every item.

        Only the latest report is kept, in memory; the worker writes it with its next lease
        renewal (the row's ``progress``, shown in the admin and by ``get_result()``). Raises
        TypeError or ValueError for a report that is not non-negative ints with ``done`` at
        most ``total``; a ``note`` longer than 200 characters is cut.
        """
        report = checked_report(done, total, note, attempt=self.attempt)
        with self._progress_lock:
            self._progress = report
            self._progress_made += 1

    @property
    def last_progress(self) -> Progress | None:
        """The latest report this attempt made, written or not."""
        return self._progress

    def unsent_progress(self) -> tuple[int, Progress] | None:
        """For the worker: the latest report if it has not been written, and its number."""
        with self._progress_lock:
            if self._progress is None or self._progress_made == self._progress_sent:
                return None
            return self._progress_made, self._progress

    def progress_sent(self, number: int) -> None:
        """For the worker: reports up to ``number`` (:meth:`unsent_progress`) are written."""
        with self._progress_lock:
            self._progress_sent = max(self._progress_sent, number)
