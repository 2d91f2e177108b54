"""The release duty: the jobs waiting for ones that ended, released by the leader.

Workers release at once what their own passes end (:mod:`jobs.worker.release`); this duty
catches the rest, every tick: jobs ended by the scheduler's own passes, by an operator, or by
a worker that stopped meanwhile.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS

from jobs import queue


class DependentsRelease:
    """Release the jobs waiting for ones that ended (``jobs.queue.dependencies.release``)."""

    def __init__(self, *, using: str = DEFAULT_DB_ALIAS) -> None:
        self.using = using

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Release what is pending, for a while at most; ``released``: waiting jobs settled."""
        counts: Counter[str] = Counter()
        settled = queue.dependencies.release_pending(using=self.using)
        if settled:
            counts["released"] += settled
        return counts
