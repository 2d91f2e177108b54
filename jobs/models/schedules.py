"""Recorded schedule slots: at most one job per slot of a cron schedule."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class SlotKind(models.TextChoices):
    """How a recorded slot was decided."""

    ON_TIME = "on_time", _("On time")
    CATCH_UP = "catch_up", _("Catch-up")
    SKIPPED = "skipped", _("Skipped")


class ScheduleSlot(models.Model):
    """One slot of one cron schedule, recorded once, in the transaction that enqueued its job.

    ``UNIQUE (schedule, slot)`` is the whole guarantee of at most one job per slot: a second
    scheduler, a tick replayed after a crash, or a clock jump inserts nothing and so enqueues
    nothing, even after the slot's job failed and released its job_id. A ``skipped`` row
    enqueued nothing: it records slots the misfire policy dropped (from ``missed_from`` on).
    Written only by :mod:`jobs.scheduler.slots`.
    """

    schedule = models.CharField(_("schedule"), max_length=64)
    slot = models.DateTimeField(_("slot"), help_text=_("When the slot was due."))
    kind = models.CharField(_("kind"), max_length=16, choices=SlotKind.choices)
    missed_from = models.DateTimeField(
        _("missed from"),
        null=True,
        blank=True,
        help_text=_("The first missed slot this row stands for (catch-up and skipped rows)."),
    )
    # Not a foreign key: job rows are pruned long before slot rows.
    job_pk = models.BigIntegerField(_("job row"), null=True, blank=True)
    job_id = models.CharField(_("job id"), max_length=255, blank=True, default="")
    recorded_at = models.DateTimeField(_("recorded at"), db_default=Now(), editable=False)
    recorded_by = models.CharField(_("recorded by"), max_length=200, blank=True, default="")

    class Meta:
        verbose_name = _("schedule slot")
        verbose_name_plural = _("schedule slots")
        permissions = [("run_schedule", _("Can run a schedule's job now, outside its slots"))]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "slot"], name="jobs_scheduleslot_once"),
            models.CheckConstraint(
                condition=Q(kind__in=SlotKind.values), name="jobs_scheduleslot_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(kind=SlotKind.SKIPPED, job_id="")
                | (~Q(kind=SlotKind.SKIPPED) & ~Q(job_id="")),
                name="jobs_scheduleslot_fired_has_job_id",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.slot.isoformat()} ({self.kind})"
