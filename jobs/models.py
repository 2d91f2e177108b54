"""The jobs table, its history, and the small tables beside them (overrides, pauses, slots).

Every state change of these rows goes through :mod:`jobs.queue`; nothing else writes them.
The models import nothing above them: replaying a job is :func:`jobs.queue.replay`, and
:mod:`jobs.control` dispatches the jobs tables' replay there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from jobs.conf import jobs_settings
from jobs.runs import ACTIVE_STATES, TERMINAL_STATES, RunContract, RunState

# The scheduler's slot kinds live with the slot logic, which does not need the models.
from jobs.scheduler.timing import SlotKind

PRIORITY_MIN, PRIORITY_MAX = -100, 100  # Django's task priority range; higher runs first.

#: ``run_after`` of a job waiting for others (jobs.queue.dependencies): never due, so it sits
#: past every claim's range scan. Far enough that no real schedule reaches it, near enough
#: that every time zone can still show it.
WAITING_UNTIL = datetime(9000, 1, 1, tzinfo=UTC)


def default_tenant() -> str:
    return jobs_settings.DEFAULT_TENANT


def default_queue() -> str:
    return jobs_settings.DEFAULT_QUEUE


def default_max_attempts() -> int:
    return jobs_settings.DEFAULT_MAX_ATTEMPTS


# A version 7 UUID (RFC 9562): the Unix time in milliseconds in its first 48 bits, then the
# version (7), 12 random bits, the variant (0b10) and 62 random bits.
_UUID7_FIXED = 0x7 << 76 | 0x2 << 62  # the version and variant bits
_UUID7_RANDOM = 0xFFF << 64 | (1 << 62) - 1  # where the random bits go


def new_job_id() -> str:
    """Job id for work enqueued without an idempotency key: unique, so never deduplicated.

    A version 7 UUID's 32 hex digits: time-ordered, so keyless jobs' keys go in at the end of
    the key lock index (``tenant, job_id``) instead of anywhere in it, as random ones did: a
    large table's enqueues then touch its last pages, not a page each.
    """
    return new_job_ids(1)[0]


def new_job_ids(count: int) -> list[str]:
    """``count`` ids as :func:`new_job_id` makes them, of one millisecond.

    Their random bits come from one read of the system's random source, not one a job: that
    system call was a third of drawing an id (0.33 of 1.0 µs; 0.39 µs an id this way).
    """
    fixed = time.time_ns() // 1_000_000 << 80 | _UUID7_FIXED
    random = os.urandom(10 * count)  # 74 of each id's 80 bits are used
    from_bytes = int.from_bytes
    return [
        f"{fixed | from_bytes(random[at : at + 10]) & _UUID7_RANDOM:032x}"
        for at in range(0, 10 * count, 10)
    ]


class Job(RunContract):
    """One unit of work. A retry is the same row with ``attempts + 1``, never a new row.

    ``key_held`` says whether this row holds its ``(tenant, job_id)`` idempotency key. Active
    rows always hold it (a check constraint); terminal rows keep holding it through their
    window (``SUCCESS_WINDOW`` after success, ``FAILURE_WINDOW`` after failure) so a repeat
    enqueue returns them instead of running the work again, then let it go. The partial
    UNIQUE index over key-holding rows is the whole idempotency lock: the database decides.

    A finished row that holds no key moves to :class:`JobHistory` at the next archive pass, so
    this table holds active work and the keys of recent work, not the whole past.
    """

    job_id = models.CharField(_("job id"), max_length=255, default=new_job_id)
    name = models.CharField(_("job type"), max_length=200, help_text=_("Versioned type name."))
    payload = models.JSONField(_("payload"), default=dict)
    tenant = models.CharField(_("tenant"), max_length=64, default=default_tenant)
    queue = models.CharField(_("queue"), max_length=64, default=default_queue)
    priority = models.SmallIntegerField(_("priority"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"), default=default_max_attempts)
    run_after = models.DateTimeField(
        _("run after"),
        db_default=Now(),
        help_text=_("Earliest time the job may run; a scheduled retry moves it forward."),
    )
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    claim_token = models.UUIDField(_("claim token"), null=True, blank=True)
    claimed_by = models.CharField(_("claimed by"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    key_held = models.BooleanField(_("holds its job id"), default=True)
    # False when enqueue generated the job_id: nobody can submit that id again, so the row
    # lets its key go as soon as it finishes and leaves this table at the next archive pass.
    keyed = models.BooleanField(
        _("keyed"),
        db_default=True,
        help_text=_("The job_id was given by the caller (an idempotency key), not generated."),
    )
    # Set by enqueue for job types the claim reads tenant by tenant (fairness, tenant limits;
    # jobs.queue.flow): such rows are in the per-tenant claim index too, and no other row is.
    fair = models.BooleanField(_("in tenant order"), db_default=False, editable=False)
    # Running jobs are recovered through their leases and retry policy, not stale reaping.
    reaped_when_stale = False
    # Jobs replay through jobs.queue.replay (jobs.control dispatches there), not a method
    # here: the models sit below the queue.
    replay_description = _(
        "Queue the same job again with fresh attempts (same id, job_id and payload)."
    )
    result = models.JSONField(_("result"), null=True, blank=True)
    replayed_at = models.DateTimeField(_("replayed at"), null=True, blank=True)
    replayed_by = models.CharField(_("replayed by"), max_length=150, blank=True, default="")
    # An operator asked the running attempt to stop; the worker learns of it at its next
    # lease renewal and the attempt ends cancelled.
    cancel_requested_at = models.DateTimeField(_("cancel requested at"), null=True, blank=True)
    cancel_requested_by = models.CharField(
        _("cancel requested by"), max_length=150, blank=True, db_default=""
    )
    attempt_log = models.JSONField(
        _("attempts"),
        db_default=models.Value([], output_field=models.JSONField()),
        editable=False,
        help_text=_("Every finished attempt: start, end, worker, outcome, error."),
    )
    # The batch this job is a member of (jobs.queue.batches). Not a database foreign key:
    # the settle trigger keeps the batch's counts, and no insert pays for a key check.
    batch = models.ForeignKey(
        "Batch",
        verbose_name=_("batch"),
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="jobs",
        editable=False,
    )
    # How many of the jobs this one waits for (jobs.queue.dependencies) have not succeeded
    # yet. A waiting job is queued with run_after at WAITING_UNTIL, so no claim reaches it.
    waiting_on = models.PositiveIntegerField(_("waiting on"), db_default=0, editable=False)
    # Other jobs wait for this one: the settle trigger releases or ends them when it finishes.
    depended_on = models.BooleanField(_("depended on"), db_default=False, editable=False)
    # The handler's last progress report ({"done", "total", "note"}), carried by the lease
    # renewal the worker already makes.
    progress = models.JSONField(_("progress"), null=True, blank=True, editable=False)

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        permissions = [
            ("replay_job", _("Can replay failed jobs")),
            ("cancel_job", _("Can cancel queued and running jobs")),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "job_id"],
                condition=Q(key_held=True),
                name="jobs_job_key_lock",
            ),
            models.CheckConstraint(
                condition=Q(key_held=True) | ~Q(state__in=ACTIVE_STATES),
                name="jobs_job_active_holds_key",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=PRIORITY_MIN, priority__lte=PRIORITY_MAX),
                name="jobs_job_priority_range",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="jobs_job_max_attempts_positive"
            ),
            models.CheckConstraint(
                condition=Q(state__in=RunState.values), name="jobs_job_state_valid"
            ),
            models.CheckConstraint(
                condition=~Q(state=RunState.RUNNING)
                | Q(claim_token__isnull=False, lease_expires_at__isnull=False),
                name="jobs_job_running_is_leased",
            ),
        ]
        indexes = [
            # The claim path: due queued rows of one type, in claim order. Lease and heartbeat
            # columns stay out of every index so lease renewals are HOT updates.
            models.Index(
                F("name"),
                F("priority").desc(),
                F("run_after"),
                F("id"),
                condition=Q(state=RunState.QUEUED),
                name="jobs_job_claim",
            ),
            # The claim path of types read tenant by tenant (jobs.queue.flow): the tenants
            # with queued rows of a type, and each tenant's rows in claim order. Only rows of
            # such types are in it, so other types pay nothing for it.
            models.Index(
                F("name"),
                F("tenant"),
                F("priority").desc(),
                F("run_after"),
                F("id"),
                condition=Q(state=RunState.QUEUED, fair=True),
                name="jobs_job_tenant_claim",
            ),
            # Running rows (few): lease sweeps, per-type running counts, the watchdog.
            models.Index(
                fields=["name"], condition=Q(state=RunState.RUNNING), name="jobs_job_running"
            ),
            # Queued rows that have run before (retries), by type and attempts: the exhaustion
            # pass finds rows at a type's lowered attempt limit here. Fresh rows (attempts 0),
            # the bulk of any backlog, are not in it, and enqueue never writes to it.
            models.Index(
                fields=["name", "attempts"],
                condition=Q(state=RunState.QUEUED, attempts__gt=0),
                name="jobs_job_retrying",
            ),
            # Queued rows at or over their own attempt limit: normally none at all.
            models.Index(
                fields=["id"],
                condition=Q(state=RunState.QUEUED, attempts__gte=F("max_attempts")),
                name="jobs_job_out_of_attempts",
            ),
            # The members of a batch (the successor lists failures, the admin lists members).
            models.Index(fields=["batch"], condition=Q(batch__isnull=False), name="jobs_job_batch"),
            # Terminal rows by whether they still hold their key, then age: the archive pass
            # takes the oldest rows that let go (or whose window passed) in index order.
            models.Index(
                fields=["state", "key_held", "finished_at"],
                condition=Q(state__in=TERMINAL_STATES),
                name="jobs_job_terminal",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.job_id} ({self.state})"

    # Django lets a subclass replace an abstract parent's field with a plain attribute; the
    # stubs see a writeable field overridden by a read-only property.
    @property
    def next_retry_at(self) -> datetime | None:  # type: ignore[override]
        """When a retry is scheduled: the due time of a queued job that already ran.

        The jobs table keeps the retry time in ``run_after`` (the claim path orders by it), so
        this run-contract field is derived here instead of stored twice.
        """
        if self.state == RunState.QUEUED and self.attempts > 0:
            return self.run_after
        return None

    @classmethod
    def eligible_for_replay(cls, pks: Iterable[Any]) -> list[Any]:
        """Failed jobs among ``pks``, here or already moved to the history (replay finds both).

        A page listing ``jobs.job:<id>`` may be confirmed after the archive moved the row.
        """
        pks = list(pks)
        return sorted({*super().eligible_for_replay(pks), *JobHistory.eligible_for_replay(pks)})


class JobHistory(RunContract):
    """A finished job that no longer holds its key, moved out of the jobs table.

    The table is partitioned by state, then by ``finished_at`` (an hour or a day per
    partition, see :mod:`jobs.queue.history`), so retention drops whole partitions instead of
    deleting rows, and ten million finished rows cost the claim path nothing. Rows keep the
    id they had in ``jobs_job``; replay moves a row back there under that id. Written only
    by :mod:`jobs.queue`.
    """

    id = models.BigIntegerField(_("id"), primary_key=True)
    job_id = models.CharField(_("job id"), max_length=255)
    name = models.CharField(_("job type"), max_length=200)
    payload = models.JSONField(_("payload"), default=dict)
    tenant = models.CharField(_("tenant"), max_length=64)
    queue = models.CharField(_("queue"), max_length=64)
    priority = models.SmallIntegerField(_("priority"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"))
    run_after = models.DateTimeField(_("run after"))
    claimed_by = models.CharField(_("claimed by"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    keyed = models.BooleanField(_("keyed"), default=True)
    result = models.JSONField(_("result"), null=True, blank=True)
    replayed_at = models.DateTimeField(_("replayed at"), null=True, blank=True)
    replayed_by = models.CharField(_("replayed by"), max_length=150, blank=True, default="")
    attempt_log = models.JSONField(
        _("attempts"),
        db_default=models.Value([], output_field=models.JSONField()),
        editable=False,
    )
    batch_id = models.BigIntegerField(_("batch"), null=True, blank=True)
    progress = models.JSONField(_("progress"), null=True, blank=True)
    archived_at = models.DateTimeField(_("archived at"), db_default=Now(), editable=False)
    # Finished rows are never retried in place.
    next_retry_at = None
    reaped_when_stale = False
    monitor_permission_model = "job"
    replay_description = _(
        "Move the job back to the jobs table and queue it again with fresh attempts."
    )

    class Meta:
        db_table = "jobs_jobhistory"
        verbose_name = _("finished job")
        verbose_name_plural = _("finished jobs")
        # Partitioned: no unique index can cover id alone, and finished rows need no lock.
        constraints = ()

    def __str__(self) -> str:
        return f"{self.name} {self.job_id} ({self.state})"

    @classmethod
    def replay_permission(cls) -> str:
        return "jobs.replay_job"

    @classmethod
    def replayed_rows(cls, pks: Iterable[Any]) -> models.QuerySet[Any]:
        """A replayed finished job is back in the jobs table, under the same id."""
        return Job.objects.filter(pk__in=list(pks))


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


class FlowGate(models.Model):
    """One row per job type with a limit the whole fleet shares (jobs.queue.flow).

    Every claim of such a type locks its row and, when it starts jobs, bumps ``version``: a
    claim that finds the row changed since its snapshot claims nothing this time, so the
    running jobs and buckets each claim reads are exact. ``tokens`` and ``refilled_at`` are
    the type's rate-limit bucket. ``tenant_ordered`` tells enqueue to put the type's jobs in
    the per-tenant claim index. Written by workers from their registry and by claims only.
    """

    name = models.CharField(_("job type"), max_length=200, primary_key=True)
    version = models.BigIntegerField(default=0)
    tokens = models.FloatField(null=True)
    refilled_at = models.DateTimeField(db_default=Now())
    tenant_ordered = models.BooleanField(default=False)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "jobs_flow"
        verbose_name = _("flow gate")
        verbose_name_plural = _("flow gates")

    def __str__(self) -> str:
        return self.name


class TenantBucket(models.Model):
    """A (job type, tenant) rate-limit bucket, written by the claims of that type only."""

    pk = models.CompositePrimaryKey("name", "tenant")
    name = models.CharField(_("job type"), max_length=200)
    tenant = models.CharField(_("tenant"), max_length=64)
    tokens = models.FloatField()
    refilled_at = models.DateTimeField()

    class Meta:
        db_table = "jobs_flowtenant"
        verbose_name = _("tenant bucket")
        verbose_name_plural = _("tenant buckets")

    def __str__(self) -> str:
        return f"{self.name} / {self.tenant}"


class TenantWeight(models.Model):
    """A tenant's weight in the fair order of fair job types: twice the weight, twice the share.

    Tenants without a row weigh 1.
    """

    tenant = models.CharField(_("tenant"), max_length=64, primary_key=True)
    weight = models.PositiveIntegerField(_("weight"), default=1)

    class Meta:
        verbose_name = _("tenant weight")
        verbose_name_plural = _("tenant weights")
        constraints = [
            models.CheckConstraint(
                condition=Q(weight__gte=1, weight__lte=1000), name="jobs_tenantweight_range"
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant} (weight {self.weight})"


class FairAccount(models.Model):
    """A tenant's account in the fair order of a fair job type without tenant limits: its
    starts so far, each counted as 1/weight, so that the claims serve the least served first
    and each tenant's share of the starts follows its weight over time (jobs.queue.flow).

    ``served`` is NULL while the account is at rest (the tenant had nothing due when a claim
    read it): it comes back into play level with the least served. ``starts`` counts every
    start in fair order. Written by the claims of that type only.
    """

    pk = models.CompositePrimaryKey("name", "tenant")
    name = models.CharField(_("job type"), max_length=200)
    tenant = models.CharField(_("tenant"), max_length=64)
    served = models.FloatField(null=True)
    starts = models.BigIntegerField(db_default=0)

    class Meta:
        verbose_name = _("fair account")
        verbose_name_plural = _("fair accounts")
        indexes = [
            # The claim reads a type's accounts in play least served first.
            models.Index(
                fields=["name", "served", "tenant"],
                name="jobs_fairaccount_served",
                condition=Q(served__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} / {self.tenant}"


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
    """One step of a job that changes the world outside the database (jobs.effects).

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
