"""The run contract: the lifecycle vocabulary every run table shares.

A run table is any table whose rows are units of background work: the jobs table itself, an
email delivery table, a dead-letter table, a curation run table. They share one skeleton so the
watchdog and the failure monitor can work over all of them, while each domain keeps its data and
its own meaning of "redo the work" (:meth:`RunContract.replay`)::

    queued ──claim──▶ running ──▶ succeeded
      ▲                 │    └──▶ failed   (last_error: a code, e.g. handler_error, stale)
      └──retry/release──┘
    queued ──cancel──▶ cancelled

``queued`` and ``running`` are the *active* states. Every transition between two active states
stays inside that set, so a row never enters the active-state lock except on creation or on an
explicit replay, and the partial UNIQUE index can only be tripped at those two places.

This module is importable without the ``jobs`` app's models (like Django's
``AbstractBaseSession``), so domain apps can subclass :class:`RunContract` freely.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.apps import apps
from django.db import DEFAULT_DB_ALIAS, models, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.functional import Promise
from django.utils.translation import gettext_lazy as _


class RunState(models.TextChoices):
    QUEUED = "queued", _("Queued")
    RUNNING = "running", _("Running")
    SUCCEEDED = "succeeded", _("Succeeded")
    FAILED = "failed", _("Failed")
    CANCELLED = "cancelled", _("Cancelled")


ACTIVE_STATES: tuple[str, ...] = (RunState.QUEUED, RunState.RUNNING)
TERMINAL_STATES: tuple[str, ...] = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


class ErrorCode(models.TextChoices):
    """Values of ``last_error``: why a run failed or was last retried (the outcome table)."""

    INVALID_PAYLOAD = "invalid_payload", _("Invalid payload")
    REJECTED = "rejected", _("Rejected by handler")
    DEADLINE_EXCEEDED = "deadline_exceeded", _("Deadline exceeded")
    HANDLER_ERROR = "handler_error", _("Handler error")
    LEASE_EXPIRED = "lease_expired", _("Lease expired")
    ATTEMPTS_EXHAUSTED = "attempts_exhausted", _("Attempts exhausted")
    STALE = "stale", _("Stale (reaped by the watchdog)")
    CANCELLED = "cancelled", _("Cancelled")


class RunContract(models.Model):
    """Abstract base for run tables; subclass it and fill in :meth:`replay`.

    A subclass may drop a field that does not apply to it by setting it to ``None`` (Django's
    rule for abstract fields), e.g. ``next_retry_at = None`` for a table that never retries.
    The active-state lock is ``UNIQUE (job_id) WHERE state IN ('queued', 'running')``; a
    subclass that needs a wider key replaces ``Meta.constraints``.
    """

    job_id = models.CharField(
        _("job id"),
        max_length=255,
        help_text=_("Idempotency key: at most one active row per key."),
    )
    state = models.CharField(
        _("state"), max_length=16, choices=RunState.choices, default=RunState.QUEUED
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    heartbeat_at = models.DateTimeField(_("heartbeat at"), null=True, blank=True)
    # A code (ErrorCode for the shared ones; a domain may add its own), deliberately without
    # field choices: a new code must not force a migration on every run table.
    last_error = models.CharField(_("last error"), max_length=32, blank=True, default="")
    error_detail = models.TextField(_("error detail"), blank=True, default="")
    next_retry_at = models.DateTimeField(_("next retry at"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), db_default=Now(), editable=False)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)

    # How long a running row may go without a heartbeat before the watchdog reaps it;
    # None means the JOBS["STALE_AFTER"] setting.
    stale_after: ClassVar[timedelta | None] = None
    # False for tables whose running rows are recovered some other way (the jobs table:
    # leases and the retry policy), so the generic stale reaping skips them.
    reaped_when_stale: ClassVar[bool] = True

    # How the failure monitor (jobs.control) reads this table. A field name that the table
    # does not have counts as None, so the defaults (the jobs table's own names) are harmless
    # elsewhere; a table whose ``name`` or ``tenant`` column means something else sets None.
    # Where a column is None, the monitor filter on it leaves this table out while it is set.
    # The label in the monitor's "module" column and filter; "" means "app_label.model_name".
    monitor_label: ClassVar[str] = ""
    # The field holding each row's job type, and the job type of every row when there is none.
    monitor_job_type_field: ClassVar[str | None] = "name"
    monitor_job_type: ClassVar[str] = ""
    # The field holding each row's tenant.
    monitor_tenant_field: ClassVar[str | None] = "tenant"
    # Another model of the same app whose view and change permissions also let a user read
    # this table (the finished-jobs history reads as the jobs table does); "" for none.
    monitor_permission_model: ClassVar[str] = ""
    # What replay means here, shown on the replay confirmation page; "" means the first line
    # of the replay() docstring. A lazy translation (gettext_lazy) is fine.
    replay_description: ClassVar[str | Promise] = ""

    class Meta:
        abstract = True
        constraints = [
            models.UniqueConstraint(
                fields=["job_id"],
                condition=Q(state__in=ACTIVE_STATES),
                name="%(app_label)s_%(class)s_active_lock",
            ),
        ]

    @classmethod
    def replay(cls, pks: Iterable[int], *, by: str) -> int:
        """Redo the work of the given failed rows in this domain's own way; return how many.

        The jobs table re-queues the same row; a mail table resends; a curation table starts
        a new run. Must be idempotent: replaying a row twice redoes the work once.
        """
        raise NotImplementedError(f"{cls.__name__} must define replay()")

    @classmethod
    def replay_eligible(cls) -> Q:
        """Rows :meth:`replay` would act on; the monitor offers replay for these only.

        A domain with a further condition (a run already replaced by a newer one) narrows it.
        """
        return Q(state=RunState.FAILED)

    @classmethod
    def eligible_for_replay(cls, pks: Iterable[Any]) -> list[Any]:
        """Which of ``pks`` replay would act on now, sorted (one query).

        The rows matching :meth:`replay_eligible` by default; a table whose rows may have
        moved elsewhere by the time an operator confirms (the jobs table's finished rows go
        to its history) looks there too.
        """
        return sorted(
            cls._default_manager.filter(pk__in=list(pks))
            .filter(cls.replay_eligible())
            .values_list("pk", flat=True)
        )

    @classmethod
    def replayed_rows(cls, pks: Iterable[Any]) -> models.QuerySet[Any]:
        """Where replayed rows are now, for the admin's record of who replayed them.

        The rows themselves by default; a table whose replay moves rows elsewhere (finished
        jobs go back to the jobs table) names that table's rows.
        """
        return cls._default_manager.filter(pk__in=list(pks))

    @classmethod
    def replay_permission(cls) -> str:
        """The permission an operator needs to replay rows of this table.

        By convention ``<app_label>.replay_<model_name>``, declared in ``Meta.permissions``
        (the jobs table declares ``jobs.replay_job``).
        """
        return f"{cls._meta.app_label}.replay_{cls._meta.model_name}"


def run_contract_models() -> list[type[RunContract]]:
    """Every concrete (non-abstract, non-proxy) run table known to Django's app registry."""
    return [
        model
        for model in apps.get_models()
        if issubclass(model, RunContract) and not model._meta.proxy
    ]


def reap_stale(
    model: type[RunContract],
    *,
    stale_after: timedelta,
    now: datetime | None = None,
    limit: int = 100,
    unless_active: Sequence[tuple[str, str]] = (),
    using: str = DEFAULT_DB_ALIAS,
) -> list[int]:
    """Fail running rows whose pulse stopped, freeing their active-state lock; returns pks.

    A row is stale when its last heartbeat (or, if it never beat, its creation) is older than
    ``stale_after``. It becomes ``failed`` with ``last_error = "stale"``. Rows locked by
    someone else are skipped, and at most ``limit`` rows are reaped per call.

    ``unless_active`` lists the (job type, payload field) pairs of job types bound to this
    table: a row that an active job of one of them names is its job's to settle, and is
    skipped whatever its heartbeat says.
    """
    now = now or timezone.now()
    cutoff = now - stale_after
    running = model._default_manager.using(using).filter(state=RunState.RUNNING)
    if any(f.name == "heartbeat_at" for f in model._meta.concrete_fields):
        stale = Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True, created_at__lt=cutoff)
    else:
        stale = Q(created_at__lt=cutoff)
    if unless_active:
        running = running.extra(  # fixed SQL; the values are parameters
            where=[_no_active_job(model, len(unless_active))],
            params=[value for pair in unless_active for value in pair],
        )
    with transaction.atomic(using=using):
        pks = list(
            running.filter(stale)
            .order_by("pk")
            .select_for_update(skip_locked=True)
            .values_list("pk", flat=True)[:limit]
        )
        if pks:
            model._default_manager.using(using).filter(pk__in=pks).update(
                state=RunState.FAILED,
                last_error=ErrorCode.STALE,
                error_detail=f"no heartbeat for {stale_after} (reaped at {now.isoformat()})",
                finished_at=now,
            )
    return pks


def _no_active_job(model: type[RunContract], bindings: int) -> str:
    """SQL: no active job of a bound type names this row (one name/field pair per binding)."""
    column = model._meta.pk.column
    assert column is not None  # only fields without a column (many-to-many) have None
    row = f"{connection_quote(model._meta.db_table)}.{connection_quote(column)}"
    names = " OR ".join(["(j.name = %s AND j.payload ->> %s = " + row + "::text)"] * bindings)
    return (
        "NOT EXISTS (SELECT 1 FROM jobs_job j "
        f"WHERE j.state IN ('queued', 'running') AND ({names}))"
    )


def connection_quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
