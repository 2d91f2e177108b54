"""Workflows: batches, dependencies between jobs, the settlement log, and the effect journal."""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from jobs.models.jobs import default_tenant


class Batch(models.Model):
    """A group of jobs whose successor is enqueued once, when every member has finished.

    The counts are of terminal outcomes, not successes: a member that fails or is cancelled
    counts as finished too. They are kept by the ``jobs_job_settled`` trigger in the same
    transaction as the member's state change, so no crash can separate the two; the
    successor is inserted by the statement that settles the last member of a sealed batch,
    once (``fired_at``). Written only by :mod:`jobs.queue.batches` and that trigger.
    """

    id = models.BigAutoField(primary_key=True)
    tenant = models.CharField(_("tenant"), max_length=64, default=default_tenant)
    description = models.CharField(_("description"), max_length=200, blank=True, default="")
    created_at = models.DateTimeField(_("created at"), db_default=Now(), editable=False)
    created_by = models.CharField(_("created by"), max_length=200, blank=True, default="")
    sealed_at = models.DateTimeField(
        _("sealed at"),
        null=True,
        blank=True,
        help_text=_("When the batch stopped waiting for its creator to add members."),
    )
    total = models.PositiveIntegerField(_("members"), default=0)
    succeeded = models.PositiveIntegerField(_("succeeded"), default=0)
    failed = models.PositiveIntegerField(_("failed"), default=0)
    cancelled = models.PositiveIntegerField(_("cancelled"), default=0)
    # The successor's jobs_job row as column values, written when the batch is opened.
    successor = models.JSONField(_("successor"), null=True, blank=True, editable=False)
    successor_pk = models.BigIntegerField(_("successor job"), null=True, blank=True)
    fired_at = models.DateTimeField(
        _("finished at"),
        null=True,
        blank=True,
        help_text=_("When the last member finished and the successor was enqueued."),
    )

    class Meta:
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        constraints = [
            models.CheckConstraint(
                condition=Q(total__gte=F("succeeded") + F("failed") + F("cancelled")),
                name="jobs_batch_counts_within_total",
            ),
        ]
        indexes = [
            models.Index(
                fields=["successor_pk"],
                condition=Q(successor_pk__isnull=False),
                name="jobs_batch_successor",
            ),
            # Retention deletes finished batches by age.
            models.Index(
                fields=["fired_at"], condition=Q(fired_at__isnull=False), name="jobs_batch_fired"
            ),
        ]

    def __str__(self) -> str:
        return f"batch {self.pk} ({self.succeeded + self.failed + self.cancelled}/{self.total})"

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed + self.cancelled


class DependencyFailure(models.TextChoices):
    """What happens to a waiting job when a job it waits for fails or is cancelled."""

    CANCEL = "cancel", _("cancel the waiting job")
    FAIL = "fail", _("fail the waiting job")


class Dependency(models.Model):
    """``job`` may run only after ``upstream`` has succeeded (jobs.queue.dependencies).

    Both are ``jobs_job`` row ids. The edge lives as long as the waiting job is in the jobs
    table; the archive pass deletes it with the row.
    """

    pk = models.CompositePrimaryKey("job", "upstream")
    job = models.BigIntegerField(_("waiting job"))
    upstream = models.BigIntegerField(_("waits for"))
    on_failure = models.CharField(
        _("if it fails"),
        max_length=8,
        choices=DependencyFailure.choices,
        default=DependencyFailure.CANCEL,
    )
    # The upstream's outcome has been applied to the waiting job (once, whoever applies it).
    settled = models.BooleanField(_("settled"), default=False, db_default=False)
    # When the edge was made (its statement's time): a release pending from before a replay
    # of the upstream applies only to edges made before it (jobs.queue.dependencies).
    created_at = models.DateTimeField(_("created at"), db_default=Now())

    class Meta:
        verbose_name = _("dependency")
        verbose_name_plural = _("dependencies")
        indexes = [
            models.Index(fields=["upstream"], name="jobs_dependency_upstream"),
            # The edges a release has yet to apply, in the order it applies them.
            models.Index(
                fields=["upstream", "job"],
                name="jobs_dependency_unsettled",
                condition=Q(settled=False),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(on_failure__in=DependencyFailure.values),
                name="jobs_dependency_on_failure_valid",
            ),
            models.CheckConstraint(
                condition=~Q(job=F("upstream")), name="jobs_dependency_not_self"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job} after {self.upstream}"


class Settlement(models.Model):
    """A job others wait for has ended, and the jobs waiting for it are not all released yet.

    The settle trigger inserts one when such a job ends; ``jobs.queue.dependencies.release``
    applies it to the waiting jobs in bounded steps and deletes it when done.
    """

    id = models.BigAutoField(primary_key=True)
    upstream = models.BigIntegerField(_("ended job"))
    state = models.CharField(_("ended as"), max_length=16)
    created_at = models.DateTimeField(_("ended at"), db_default=Now())
    # Set when the job is replayed before this is applied: it then applies only to the
    # edges made before that (the jobs that waited for it when it ended).
    cutoff = models.DateTimeField(_("replayed at"), null=True, blank=True)

    class Meta:
        verbose_name = _("settlement")
        verbose_name_plural = _("settlements")
        indexes = [models.Index(fields=["upstream", "id"], name="jobs_settlement_upstream")]

    def __str__(self) -> str:
        return f"job {self.upstream} ended {self.state}"


class EffectState(models.TextChoices):
    INTENT = "intent", _("intent recorded")
    DONE = "done", _("done")


class Effect(models.Model):
    """One step of a job that changes the world outside the database (jobs.api.effects).

    ``intent`` is committed before the external call and ``done`` (with the call's result)
    after it: a later attempt that finds only the intent knows the call may have happened and
    reconciles instead of calling blindly. ``job`` is the ``jobs_job`` row id; the row lives
    as long as its job does (in the jobs table or its history), and the retention pass
    deletes it once the job is gone from both. Written only by :mod:`jobs.queue.effects`.
    """

    pk = models.CompositePrimaryKey("job", "step")
    job = models.BigIntegerField(_("job"))
    step = models.CharField(_("step"), max_length=200)
    key = models.CharField(_("effect key"), max_length=64)
    state = models.CharField(_("state"), max_length=8, choices=EffectState.choices)
    result = models.JSONField(_("result"), null=True, blank=True)
    attempt = models.PositiveIntegerField(_("attempt"))
    started_at = models.DateTimeField(_("intent recorded at"), db_default=Now())
    finished_at = models.DateTimeField(_("done at"), null=True, blank=True)

    class Meta:
        verbose_name = _("effect")
        verbose_name_plural = _("effects")
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=EffectState.values), name="jobs_effect_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(state=EffectState.INTENT, finished_at__isnull=True)
                | Q(state=EffectState.DONE, finished_at__isnull=False),
                name="jobs_effect_done_has_finished_at",
            ),
        ]
        # The retention pass looks for rows of jobs gone, oldest first.
        indexes = [models.Index(fields=["started_at"], name="jobs_effect_started")]

    def __str__(self) -> str:
        return f"job {self.job} {self.step} ({self.state})"
