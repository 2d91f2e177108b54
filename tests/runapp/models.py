"""Two domain run tables: one reaped after ``JOBS["STALE_AFTER"]``, one after its own second."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.db import models

from jobs.runs import RunContract, RunState


class Delivery(RunContract):
    """An email delivery whose sending loop stamps its own heartbeat."""

    recipient = models.CharField(max_length=200, default="")

    class Meta(RunContract.Meta):
        permissions = [("replay_delivery", "Can replay deliveries")]

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Send the email again: the failed row goes back to queued."""
        return cls.objects.filter(pk__in=list(pks), state=RunState.FAILED).update(
            state=RunState.QUEUED, attempts=0, last_error="", error_detail="", finished_at=None
        )


class QuickRun(RunContract):
    """A run whose pulse is expected every fraction of a second (for real-process tests)."""

    stale_after = timedelta(seconds=1)
    next_retry_at = None  # never retried: the field does not apply

    class Meta(RunContract.Meta):
        permissions = [("replay_quickrun", "Can replay quick runs")]

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Start a fresh run with the same key (the failed row stays as history)."""
        failed = cls.objects.filter(pk__in=list(pks), state=RunState.FAILED)
        return len(cls.objects.bulk_create(cls(job_id=row.job_id) for row in failed))
