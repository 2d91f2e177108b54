"""What the console's charts read: per-minute rollups of attempts and samples of the backlog."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _


class HistogramField(models.Field):  # type: ignore[type-arg]
    """A PostgreSQL ``integer[]`` of bucket counts, without ``django.contrib.postgres``.

    psycopg reads and writes Python lists of ints as arrays; only :mod:`jobs.queue.rollup`
    writes these columns, in SQL.
    """

    description = "Histogram bucket counts (integer[])"

    def db_type(self, connection: Any) -> str:
        return "integer[]"


class RollupOutcome(models.TextChoices):
    SUCCEEDED = "succeeded", _("succeeded")
    FAILED = "failed", _("failed")
    CANCELLED = "cancelled", _("cancelled")
    RETRIED = "retried", _("retried")


class Rollup(models.Model):
    """Finished attempts counted per period, job type, outcome and error code.

    The history the console charts, kept after the job rows are pruned. Minute rows are added
    to by the statements that write outcomes, one row per writing session (``shard``, its
    backend pid) so that concurrent workers never wait on each other's row; the scheduler's
    retention folds minute rows into hour rows (``shard`` 0) and deletes hour rows after
    ``ROLLUP_RETENTION``. Run and wait times are histograms over :data:`jobs.queue.rollup.BOUNDS`.
    Written only by :mod:`jobs.queue.rollup`.
    """

    pk = models.CompositePrimaryKey("period", "width", "name", "outcome", "code", "shard")
    period = models.DateTimeField(_("period"), help_text=_("When the period starts."))
    width = models.IntegerField(_("width"), help_text=_("The period's length in seconds."))
    name = models.CharField(_("job type"), max_length=200)
    outcome = models.CharField(_("outcome"), max_length=16, choices=RollupOutcome.choices)
    code = models.CharField(_("error code"), max_length=32, blank=True, default="")
    shard = models.IntegerField(_("shard"))
    count = models.BigIntegerField(_("attempts"))
    run_seconds = models.FloatField(_("run time, total"))
    wait_seconds = models.FloatField(_("queue latency, total"))
    run_histogram = HistogramField(_("run time histogram"))
    wait_histogram = HistogramField(_("queue latency histogram"))

    class Meta:
        verbose_name = _("rollup")
        verbose_name_plural = _("rollups")
        constraints = [
            models.CheckConstraint(
                condition=Q(outcome__in=RollupOutcome.values), name="jobs_rollup_outcome_valid"
            ),
            models.CheckConstraint(condition=Q(width__gt=0), name="jobs_rollup_width_positive"),
        ]
        # The retention pass folds minute rows by age: without this it reads every hour row.
        indexes = [
            models.Index(fields=["period"], condition=Q(width=60), name="jobs_rollup_minutes")
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.outcome} @ {self.period.isoformat()} ({self.count})"


class BacklogSample(models.Model):
    """Queued and due jobs of one type, sampled by the scheduler's gauges duty once a minute.

    Minute samples are folded into hour samples (the hour's largest) by the retention pass,
    and hour samples deleted after ``ROLLUP_RETENTION``. Written only by
    :mod:`jobs.queue.rollup`.
    """

    pk = models.CompositePrimaryKey("period", "width", "name")
    period = models.DateTimeField(_("period"))
    width = models.IntegerField(_("width"))
    name = models.CharField(_("job type"), max_length=200)
    queued = models.BigIntegerField(_("queued"))
    due = models.BigIntegerField(_("due"))
    oldest_due_seconds = models.FloatField(_("oldest due, waited"), null=True, blank=True)

    class Meta:
        verbose_name = _("backlog sample")
        verbose_name_plural = _("backlog samples")
        indexes = [
            models.Index(
                fields=["period"], condition=Q(width=60), name="jobs_backlogsample_minutes"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} @ {self.period.isoformat()}: {self.queued}"
