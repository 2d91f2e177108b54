"""How operators see one run table: its label, the columns it has, filtered queries, replay.

Every concrete :class:`~jobs.runs.RunContract` model is a :class:`RunTable`. The monitor's
class attributes on the model (``monitor_label``, ``monitor_job_type_field``,
``monitor_job_type``, ``monitor_tenant_field``) say which columns exist; a filter on a column
a table does not have leaves that table out while the filter is set.

Replay goes to each table's own meaning: ``Model.replay`` for domain tables, and
:func:`jobs.queue.replay` for the jobs table and its history, which the models may not call
themselves (they sit below the queue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, Protocol

from django.db.models import (
    BooleanField,
    DateTimeField,
    ExpressionWrapper,
    F,
    IntegerField,
    Model,
    QuerySet,
    Value,
)
from django.db.models.functions import Now, Right, Substr
from django.urls import NoReverseMatch, reverse
from django.utils.translation import gettext_lazy as _

from jobs import queue
from jobs.models import Job, JobHistory
from jobs.runs import TERMINAL_STATES, RunContract, run_contract_models

SUMMARY_CHARS = 240  # error detail is cut in SQL, so a long traceback is never loaded
# The age filter's choices ("newer than"), shared by the admin and ``manage.py replay``.
AGES: dict[str, tuple[timedelta, Any]] = {
    "1h": (timedelta(hours=1), _("Last hour")),
    "24h": (timedelta(hours=24), _("Last 24 hours")),
    "7d": (timedelta(days=7), _("Last 7 days")),
    "30d": (timedelta(days=30), _("Last 30 days")),
}


def _replay_jobs(pks: Iterable[Any], *, by: str) -> int:
    """Queue the same jobs again: the queue brings rows back from the history first."""
    return len(queue.replay(pks, by=by).replayed)


# Tables whose replay is the queue's, not a method of their model.
JOB_TABLES: dict[type[RunContract], Callable[..., int]] = {
    Job: _replay_jobs,
    JobHistory: _replay_jobs,
}


class Operator(Protocol):
    """Who views and replays: ``request.user``, of any user model, or AnonymousUser."""

    @property
    def pk(self) -> Any: ...

    def get_username(self) -> str: ...

    def has_perm(self, perm: str, obj: Model | None = None) -> bool: ...


@dataclass(frozen=True)
class Filters:
    """What the operator asked for. ``state=""`` means every state; ``age`` means "newer than"."""

    module: str = ""
    state: str = "failed"
    job_type: str = ""
    tenant: str = ""
    error: str = ""
    age: timedelta | None = None
    q: str = ""


@dataclass(frozen=True)
class Row:
    """One row of any run table, projected to the monitor's common columns."""

    table: RunTable
    pk: Any
    job_id: str
    state: str
    attempts: int | None
    job_type: str
    tenant: str
    error: str
    summary: str
    created_at: datetime
    finished_at: datetime | None
    at: datetime | None
    replayable: bool

    @property
    def token(self) -> str:
        """How forms name this row across tables: ``<label>:<pk>``."""
        return f"{self.table.label}:{self.pk}"

    @property
    def admin_url(self) -> str | None:
        return self.table.change_url(self.pk)

    def sort_key(self) -> tuple[Any, ...]:
        """Newest first, the order each table's query returns (NULL times sort first)."""
        return (self.at is None, self.at or datetime.min, self.table.label, self.pk)


class RunTable:
    """A concrete run-contract model as the monitor reads it."""

    def __init__(self, model: type[RunContract]) -> None:
        self.model = model
        self.opts = model._meta
        self.label: str = model.monitor_label or self.opts.label_lower
        self.fields = {f.name for f in self.opts.concrete_fields}
        self.job_type_field = self._field(model.monitor_job_type_field)
        self.tenant_field = self._field(model.monitor_tenant_field)
        self.job_type: str = model.monitor_job_type

    def __repr__(self) -> str:
        return f"<RunTable {self.label}>"

    def _field(self, name: str | None) -> str | None:
        return name if name and name in self.fields else None

    @property
    def verbose_name(self) -> str:
        return str(self.opts.verbose_name_plural)

    @property
    def is_jobs(self) -> bool:
        """The jobs table or its history: rows of :mod:`jobs.queue`, not of a domain."""
        return self.model in JOB_TABLES

    @cached_property
    def supports_replay(self) -> bool:
        """False while a domain model still has the contract's NotImplementedError replay()."""
        if self.is_jobs:
            return True
        # mypy sees a classmethod read from its class as a plain callable, without __func__.
        return self.model.replay.__func__ is not RunContract.replay.__func__  # type: ignore[attr-defined]

    def replay(self, pks: list[Any], *, by: str) -> int:
        """Redo these rows' work in the table's own way; returns how many were replayed."""
        replay = JOB_TABLES.get(self.model, self.model.replay)
        return replay(pks, by=by)

    @property
    def replay_permission(self) -> str:
        return self.model.replay_permission()

    @cached_property
    def replay_description(self) -> str:
        if self.model.replay_description:
            return str(self.model.replay_description)
        doc = (self.model.replay.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def can_view(self, user: Operator) -> bool:
        """What the admin lets see the table's list: its view or its change permission.

        A table that names a ``monitor_permission_model`` is also readable with that model's.
        """
        app = self.opts.app_label
        names = {self.opts.model_name, self.model.monitor_permission_model} - {"", None}
        return any(
            user.has_perm(f"{app}.{action}_{name}")
            for name in sorted(names)  # type: ignore[type-var]
            for action in ("view", "change")
        )

    def can_replay(self, user: Operator) -> bool:
        """Replay shows the rows it acts on, so it needs the view permission as well."""
        return (
            self.supports_replay and user.has_perm(self.replay_permission) and self.can_view(user)
        )

    @property
    def view_permission(self) -> str:
        return f"{self.opts.app_label}.view_{self.opts.model_name}"

    def change_url(self, pk: Any) -> str | None:
        """The row's own admin page, or None when the model is not in the admin."""
        try:
            return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_change", args=[pk])
        except NoReverseMatch:
            return None

    def time_field(self, filters: Filters) -> str:
        """Terminal rows by when they finished, active ones (or any state) by creation."""
        if filters.state in TERMINAL_STATES and "finished_at" in self.fields:
            return "finished_at"
        return "created_at"

    def filtered(
        self, filters: Filters, *, now: datetime | None = None, eligible: bool = False
    ) -> QuerySet[RunContract] | None:
        """This table's rows matching ``filters``; None when a filter cannot apply here."""
        if filters.module and filters.module != self.label:
            return None
        qs = self.model._default_manager.all()
        if filters.state:
            qs = qs.filter(state=filters.state)
        if filters.job_type:
            if self.job_type_field:
                qs = qs.filter(**{self.job_type_field: filters.job_type})
            elif self.job_type != filters.job_type:
                return None
        if filters.tenant:
            if not self.tenant_field:
                return None
            qs = qs.filter(**{self.tenant_field: filters.tenant})
        if filters.error:
            if "last_error" not in self.fields:
                return None
            qs = qs.filter(last_error=filters.error)
        if filters.age is not None:
            clock = Now() if now is None else Value(now)
            qs = qs.filter(**{f"{self.time_field(filters)}__gte": clock - filters.age})
        if filters.q:
            qs = qs.filter(job_id__icontains=filters.q)
        if eligible:
            if not self.supports_replay:
                return None
            qs = qs.filter(self.model.replay_eligible())
        return qs

    def count(self, qs: QuerySet[RunContract], cap: int) -> int:
        """``COUNT(*)`` over at most ``cap`` rows: a huge table costs no more than ``cap``."""
        return qs.order_by().values("pk")[:cap].count()

    def rows(self, qs: QuerySet[RunContract], filters: Filters, limit: int) -> list[Row]:
        """The newest ``limit`` rows of ``qs``, projected to the common columns in one query."""
        time = self.time_field(filters)
        has_detail = "error_detail" in self.fields
        columns: dict[str, Any] = {
            "m_job_type": F(self.job_type_field) if self.job_type_field else Value(""),
            "m_tenant": F(self.tenant_field) if self.tenant_field else Value(""),
            "m_attempts": F("attempts")
            if "attempts" in self.fields
            else Value(None, output_field=IntegerField()),
            "m_error": F("last_error") if "last_error" in self.fields else Value(""),
            "m_head": Substr("error_detail", 1, SUMMARY_CHARS) if has_detail else Value(""),
            "m_tail": Right("error_detail", SUMMARY_CHARS) if has_detail else Value(""),
            "m_finished": F("finished_at")
            if "finished_at" in self.fields
            else Value(None, output_field=DateTimeField()),
            "m_replayable": ExpressionWrapper(self.model.replay_eligible(), BooleanField())
            if self.supports_replay
            else Value(False),
        }
        values = (
            qs.annotate(**columns)
            .order_by(F(time).desc(nulls_first=True), "-pk")
            .values(*dict.fromkeys(["pk", "job_id", "state", "created_at", time, *columns]))[:limit]
        )
        return [
            Row(
                table=self,
                pk=v["pk"],
                job_id=v["job_id"],
                state=v["state"],
                attempts=v["m_attempts"],
                job_type=v["m_job_type"] or self.job_type,
                tenant=v["m_tenant"],
                error=v["m_error"],
                summary=summarize(v["m_head"], v["m_tail"]),
                created_at=v["created_at"],
                finished_at=v["m_finished"],
                at=v[time],
                replayable=bool(v["m_replayable"]),
            )
            for v in values
        ]

    def eligible_pks(self, pks: list[Any]) -> list[Any]:
        """Which of ``pks`` replay would act on now (the model's ``eligible_for_replay``)."""
        return self.model.eligible_for_replay(pks)

    def to_pk(self, raw: str) -> Any:
        """Parse a primary key from a form value; raises ValidationError when it is not one."""
        return self.opts.pk.to_python(raw)


def run_tables() -> list[RunTable]:
    """Every concrete run table, discovered through Django's app registry, by label."""
    return sorted((RunTable(m) for m in run_contract_models()), key=lambda t: t.label)


def visible_tables(user: Operator) -> list[RunTable]:
    """The run tables this user may read in the admin."""
    return [table for table in run_tables() if table.can_view(user)]


def summarize(head: str, tail: str) -> str:
    """The line of an error detail worth a table cell.

    A Python traceback says what went wrong on its last line; any other detail on its first.
    """
    head, tail = head or "", tail or ""
    traceback = head.startswith("Traceback")
    lines = [line.strip() for line in (tail if traceback else head).splitlines() if line.strip()]
    if not lines:
        return ""
    if not traceback:
        return lines[0]
    # "package.module.SomeError: message" reads better as "SomeError: message".
    kind, sep, message = lines[-1].partition(": ")
    return f"{kind.rpartition('.')[2]}{sep}{message}" if " " not in kind else lines[-1]
