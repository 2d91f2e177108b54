"""The worker's share of the console's history: its attempts, counted here, written once a second.

Every other statement that ends attempts adds them to the rollup itself (jobs.queue.rollup).
The worker's one-statement pass does not: at a few jobs a statement, the rollup's upsert
would be paid on every pass (about 10 % of the drain benchmark's throughput). Instead the
pass writes its outcomes with ``count=False``, and the attempts the report says were written
(fenced and busy ones never are) are kept here as the statement would have counted them, and
added in one statement about once a second, and at a clean stop. A worker killed outright
loses at most the last second of its counts; the jobs themselves are unaffected. A flush that
fails keeps its attempts for the next one, up to :data:`HELD_MAX`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from django.db import DEFAULT_DB_ALIAS

from jobs.queue import rollup
from jobs.queue.types import Outcome, OutcomeReport
from jobs.worker.execution import Running

logger = logging.getLogger("jobs.worker")

#: Seconds between two writes of the counted attempts.
INTERVAL = 1.0
#: Attempts kept while the database refuses them; older ones are dropped beyond this.
HELD_MAX = 100_000


class History:
    """Attempts this worker wrote, waiting to be added to the rollup."""

    def __init__(self, *, interval: float = INTERVAL, using: str = DEFAULT_DB_ALIAS) -> None:
        self.interval = interval
        self.using = using
        self._held: list[rollup.Ended] = []
        self._due = time.monotonic() + interval
        self._dropped = 0

    def count(self, outcomes: Sequence[tuple[Running, Outcome]], report: OutcomeReport) -> None:
        """Keep the attempts of ``outcomes`` that ``report`` says were written."""
        now = time.monotonic()
        for running, outcome in outcomes:
            if not report.was_applied(outcome):
                continue
            item = rollup.ended(
                running.job.name,
                outcome,
                report.as_written(outcome),
                ran=now - running.claimed_at,
                waited=running.job.latency,
            )
            if item is not None:
                self._held.append(item)
        if len(self._held) > HELD_MAX:
            self._dropped += len(self._held) - HELD_MAX
            del self._held[: len(self._held) - HELD_MAX]

    def flush(self, *, now: float | None = None, force: bool = False) -> None:
        """Write the attempts held, if a second has passed (or ``force``); raises on failure,
        keeping them for the next call."""
        now = time.monotonic() if now is None else now
        if not self._held or (not force and now < self._due):
            return
        self._due = now + self.interval
        items, self._held = self._held, []
        try:
            rollup.add(items, using=self.using)
        except BaseException:
            self._held[:0] = items
            raise
        if self._dropped:
            logger.warning(
                "the console's history lost %d attempts: it could not be written meanwhile",
                self._dropped,
                extra={"action": "history_dropped", "count": self._dropped},
            )
            self._dropped = 0

    @property
    def held(self) -> int:
        return len(self._held)
