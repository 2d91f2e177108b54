"""The jobs table and its history: one row a job while it is active, one row after it ended.

Every state change of these rows goes through :mod:`jobs.queue`; nothing else writes them.
The models import nothing above them: replaying a job is :func:`jobs.queue.replay`, and
:mod:`jobs.control` dispatches the jobs tables' replay there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from jobs.core.conf import jobs_settings
from jobs.core.limits import PRIORITY_MAX, PRIORITY_MIN
from jobs.runs import ACTIVE_STATES, TERMINAL_STATES, RunContract, RunState


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
    rows with a key the caller chose always hold it (a check constraint); terminal rows keep
    holding it through their window (``SUCCESS_WINDOW`` after success, ``FAILURE_WINDOW``
    after failure) so a repeat enqueue returns them instead of running the work again, then
    let it go. The partial UNIQUE index over key-holding rows is the whole idempotency lock:
    the database decides. A keyless job's generated key can never be presented again, so
    it never holds it: its insert and its claim write no entry in that index.

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
        null=True,
        help_text=_(
            "Earliest time the job may run; a scheduled retry moves it forward. Empty while "
            "the job waits for others: it becomes due when the last of them has succeeded."
        ),
    )
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    claim_token = models.UUIDField(_("claim token"), null=True, blank=True)
    claimed_by = models.CharField(_("claimed by"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    key_held = models.BooleanField(_("holds its job id"), default=True)
    # False when enqueue generated the job_id: nobody can submit that id again, so the row
    # never holds its key and leaves this table at the next archive pass once it finishes.
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
    # yet. A waiting job is queued with no run_after: every claim asks for a run_after at or
    # before now, which NULL never is, and the claim indexes keep NULLs after every time.
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
                condition=Q(key_held=True) | ~Q(state__in=ACTIVE_STATES) | Q(keyed=False),
                name="jobs_job_active_keyed_holds_key",
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
            # Only a job that waits for others has no due time; any other would never run.
            models.CheckConstraint(
                condition=Q(run_after__isnull=False) | Q(waiting_on__gt=0),
                name="jobs_job_due_or_waiting",
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
    run_after = models.DateTimeField(_("run after"), null=True)  # empty: it never became due
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


class HistoryReady(models.Model):
    """Up to when the history is ready for rows of one terminal state: every ``finished_at``
    from now to ``until`` has its partition attached.

    The worker's pass reads it (``jobs.queue.history.READY_UNTIL``) to write a row it ends
    straight into the history, which it may do only where no partition has to be made. The
    scheduler's archive duty moves ``until`` on (``jobs.queue.history.prepare_ahead``); a
    state without a row is not ready, and its finished rows wait in the jobs table for the
    archive pass. At most one row per terminal state, read by its primary key.
    """

    state = models.CharField(_("state"), max_length=16, primary_key=True)
    until = models.DateTimeField(_("ready until"))

    class Meta:
        db_table = "jobs_historyready"
        verbose_name = _("history readiness")
        verbose_name_plural = _("history readiness")
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=TERMINAL_STATES), name="jobs_historyready_terminal"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.state} until {self.until:%Y-%m-%d %H:%M}"
