"""The operator's tables: tenant overrides, pauses, and the registry of running processes."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class TenantOverride(models.Model):
    """A (tenant, component) row takes that tenant away from the component's base workers.

    Base workers of the component skip the tenant entirely (claims, backlog, exhaustion); a
    branch worker started with ``--tenant`` runs it instead. Insert the row before starting
    the branch worker; stop that worker before deleting the row.
    """

    tenant = models.CharField(_("tenant"), max_length=64)
    component = models.CharField(_("component"), max_length=64)
    note = models.CharField(_("note"), max_length=200, blank=True, default="")
    created_at = models.DateTimeField(_("created at"), db_default=Now(), editable=False)

    class Meta:
        verbose_name = _("tenant override")
        verbose_name_plural = _("tenant overrides")
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "component"], name="jobs_tenantoverride_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant} → {self.component}"


class PauseKind(models.TextChoices):
    JOB_TYPE = "job_type", _("job type")
    QUEUE = "queue", _("queue")
    TENANT = "tenant", _("tenant")
    SCHEDULE = "schedule", _("schedule")


class Pause(models.Model):
    """A paused job type, queue, tenant or schedule, until the row is deleted.

    No worker claims a paused type's, queue's or tenant's jobs: the claim reads this table in
    the same statement, so a pause holds on every worker of every host from its commit on. A
    paused schedule fires no slot: the scheduler's tick reads the table. Written only by
    :mod:`jobs.queue`.
    """

    kind = models.CharField(_("kind"), max_length=16, choices=PauseKind.choices)
    value = models.CharField(_("paused"), max_length=200)
    reason = models.CharField(_("reason"), max_length=200, blank=True, default="")
    paused_at = models.DateTimeField(_("paused at"), db_default=Now(), editable=False)
    paused_by = models.CharField(_("paused by"), max_length=150, blank=True, default="")
    # A timed pause (a handler's throttle signal) ends by itself at this time.
    until = models.DateTimeField(_("until"), null=True, blank=True)

    class Meta:
        verbose_name = _("pause")
        verbose_name_plural = _("pauses")
        permissions = [
            ("pause_work", _("Can pause and resume job types, queues, tenants and schedules"))
        ]
        constraints = [
            models.UniqueConstraint(fields=["kind", "value"], name="jobs_pause_once"),
            models.CheckConstraint(
                condition=Q(kind__in=PauseKind.values), name="jobs_pause_kind_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} {self.value}"


class ProcessComponent(models.TextChoices):
    WORKER = "worker", _("worker")
    SCHEDULER = "scheduler", _("scheduler")


class Process(models.Model):
    """A running ``runworker`` or ``runscheduler`` process, as it last reported itself.

    The row is refreshed by the statement the process already makes every lease third (the
    worker's lease renewal, the scheduler's tick) and deleted on a clean stop. A row whose
    ``expires_at`` passed belongs to a process that died or lost the database: it is shown as
    gone, and the maintenance pass deletes it later. Written only by :mod:`jobs.queue`.
    """

    identity = models.CharField(_("identity"), max_length=200, primary_key=True)
    component = models.CharField(_("component"), max_length=16, choices=ProcessComponent.choices)
    host = models.CharField(_("host"), max_length=200)
    pid = models.IntegerField(_("pid"))
    version = models.CharField(_("version"), max_length=40)
    scope = models.CharField(_("scope"), max_length=200, blank=True, default="")
    concurrency = models.IntegerField(_("concurrency"), null=True, blank=True)
    held = models.IntegerField(_("jobs held"), default=0)
    draining = models.BooleanField(_("draining"), default=False)
    leader = models.BooleanField(_("leader"), default=False)
    started_at = models.DateTimeField(_("started at"), db_default=Now())
    last_seen_at = models.DateTimeField(_("last seen at"), db_default=Now())
    expires_at = models.DateTimeField(_("gone after"))

    class Meta:
        verbose_name = _("process")
        verbose_name_plural = _("processes")

    def __str__(self) -> str:
        return f"{self.component} {self.identity}"
