"""The worker's share of the console's history: its attempts, counted here, written once a second.

Every other statement that ends attempts adds them to the rollup itself (jobs.queue.rollup).
The worker's one-statement pass does not: at a few jobs a statement, the rollup's upsert
would be paid on every pass (about 10 % of the drain benchmark's throughput). Instead the
pass writes its outcomes with ``count=False``, and the attempts the report says were written
(fenced and busy ones never are) are added up here as the statement would have counted them
(a :class:`~jobs.queue.rollup.Tally`: a few numbers per type, outcome and code, however many
jobs), and written in one statement about once a second, and at a clean stop. A worker
killed outright loses at most the last second of its counts; the jobs themselves are
unaffected. A write that fails keeps the tally for the next one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from django.db import DEFAULT_DB_ALIAS

from jobs.queue import rollup
from jobs.queue.types import Outcome, OutcomeReport
from jobs.worker.execution import Running

#: Seconds between two writes of the counted attempts.
INTERVAL = 1.0


class History:
    """Attempts this worker wrote, waiting to be added to the rollup."""

    def __init__(self, *, interval: float = INTERVAL, using: str = DEFAULT_DB_ALIAS) -> None:
        self.interval = interval
        self.using = using
        self._tally = rollup.Tally()
        self._due = time.monotonic() + interval

    def count(self, outcomes: Sequence[tuple[Running, Outcome]], report: OutcomeReport) -> None:
        """Add the attempts of ``outcomes`` that ``report`` says were written."""
        now = time.monotonic()
        # Mostly every outcome was written as sent: then no claim token is looked up (hashing
        # a UUID is a Python call, twice a job).
        every = not report.fenced and not report.busy
        stopped = bool(report.stopped)
        for running, outcome in outcomes:
            if not every and not report.was_applied(outcome):
                continue
            item = rollup.ended(
                running.job.name,
                outcome,
                report.as_written(outcome) if stopped else outcome,
                ran=now - running.claimed_at,
                waited=running.job.latency,
            )
            if item is not None:
                self._tally.add(item)

    def count_completed(self, running: Running, outcome: Outcome) -> None:
        """Add the attempt its handler completed in its own transaction (``jobs.complete``),
        which wrote ``outcome`` without counting it, as this worker counts its own."""
        item = rollup.ended(
            running.job.name,
            outcome,
            outcome,
            ran=time.monotonic() - running.claimed_at,
            waited=running.job.latency,
        )
        if item is not None:
            self._tally.add(item)

    def flush(self, *, now: float | None = None, force: bool = False) -> None:
        """Write the tally if a second has passed (or ``force``); raises on failure, keeping
        it for the next call. Called from the thread that counts."""
        now = time.monotonic() if now is None else now
        if not self._tally or (not force and now < self._due):
            return
        self._due = now + self.interval
        rollup.add(self._tally, using=self.using)
        self._tally = rollup.Tally()

    @property
    def held(self) -> int:
        """Attempts counted and not written yet."""
        return self._tally.attempts
