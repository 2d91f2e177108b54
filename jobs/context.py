"""What a handler is told about the attempt it runs."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from django.db import DEFAULT_DB_ALIAS

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
