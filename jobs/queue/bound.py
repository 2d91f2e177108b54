"""Bound run rows: a job type whose policy names a ``run_model`` keeps that row in its job's step.

The rule: a bound row moves only when its job moves, and only by the process whose write to
the jobs table was applied (never on a fenced or failed write)::

    job                                           its bound row (payload[run_field])
    ────────────────────────────────────────────  ────────────────────────────────────────────
    an attempt starts (the worker holds it)       running, heartbeat now, attempts = attempt
    lease renewed                                 heartbeat now
    retried (applied)                             queued, next_retry_at, last_error
    succeeded / failed (applied)                  the same terminal state, last_error, detail
    handed back at shutdown (applied)             queued
    lease expired, requeued                       left as it is: the next attempt sets it
    replayed (jobs.queue.replay)                  queued again, attempts 0, error cleared
    cancelled while queued (jobs.queue.cancel)    cancelled, freeing its active-state lock

While the job is active the watchdog never reaps the row as stale, however old its heartbeat:
the job's own lease decides. A row whose job is gone or finished is reaped as usual.

This module is the rows' one writer, and the queue's own transitions call it: an outcome
written (:func:`jobs.queue.record`, :func:`~jobs.queue.record_and_claim`,
:func:`~jobs.queue.release`) moves the rows of the outcomes applied in the same transaction,
a lease renewal (:func:`~jobs.queue.renew_leases`) stamps their heartbeat, replay and cancel
move them with their jobs. Which row a job drives is its caller's to say, for the queue
imports nothing above the models: the worker names the row of each job it holds
(:class:`RunRow`, by claim token), as it decoded the payload; replay, cancel and the
maintenance sweeps read it from the job's payload by the bindings the process declared at
start-up (:func:`declare`, from the registry). A process that does not register a type does
not move its rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.functions import Now

from jobs.db import bounds as dbbounds
from jobs.queue import _db
from jobs.queue.types import Outcome, OutcomeReport
from jobs.runs import ACTIVE_STATES, TERMINAL_STATES, ErrorCode, RunContract, RunState


@dataclass(frozen=True, slots=True)
class Binding:
    """A job type bound to a run table: its jobs' payload ``field`` names their row."""

    name: str
    model: type[RunContract]
    field: str


@dataclass(frozen=True, slots=True)
class RunRow:
    """The bound row one held job drives (the worker read ``pk`` from its decoded payload)."""

    model: type[RunContract]
    pk: object


#: The run rows of held jobs, by claim token: what the worker passes to the queue's writes.
RunRows = Mapping[UUID, RunRow]

_declared: tuple[Binding, ...] = ()


def declare(bindings: Iterable[Binding]) -> None:
    """The process's bindings, from its registry (once, when the ``jobs`` app is ready)."""
    global _declared
    _declared = tuple(bindings)


def declared() -> tuple[Binding, ...]:
    """The bindings :func:`declare` set (none before the app is ready)."""
    return _declared


def bindings(model: type[RunContract]) -> list[tuple[str, str]]:
    """(job type name, payload field) of every declared type bound to ``model``."""
    return [(b.name, b.field) for b in _declared if b.model is model]


# -- the worker's writes, by the rows it names ------------------------------------------------


def involved(outcomes: Sequence[Outcome], runs: RunRows | None) -> bool:
    """Whether any of ``outcomes`` drives a run row: its write then moves the row too."""
    if not runs:
        return False
    return any(outcome.token in runs for outcome in outcomes)


def settle(
    outcomes: Sequence[Outcome], report: OutcomeReport, runs: RunRows, *, using: str
) -> None:
    """Carry the outcomes ``report`` says were applied over to their rows, as written
    (:meth:`~jobs.queue.OutcomeReport.as_written`: a retry an operator stopped ends the row
    cancelled). In the outcome write's transaction."""
    for outcome in outcomes:
        row = runs.get(outcome.token)
        if row is not None and report.was_applied(outcome):
            _ended(row, report.as_written(outcome), using)


def started(row: RunRow, *, attempt: int, using: str = DEFAULT_DB_ALIAS) -> bool:
    """An attempt of the bound job starts; False when the row is missing or not active.

    On the handler thread's connection, whose own settings the handler keeps: the statement
    bounds (:func:`jobs.db.bounds.local`) hold for this write only.
    """
    model = row.model
    values: dict[str, object] = {"state": RunState.RUNNING, "heartbeat_at": Now()}
    if _has(model, "attempts"):
        values["attempts"] = attempt
    if _has(model, "next_retry_at"):
        values["next_retry_at"] = None
    with dbbounds.local(using):
        rows = model._default_manager.using(using).filter(pk=row.pk, state__in=ACTIVE_STATES)
        return bool(rows.update(**values))


def completed(row: RunRow, outcome: Outcome, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """The handler's own transaction completed the job (``jobs.complete``) and committed:
    its row follows, on the handler's connection with the statement bounds (see
    :func:`started`)."""
    with dbbounds.local(using):
        return _ended(row, outcome, using)


def beat(runs: Iterable[RunRow], *, using: str) -> list[tuple[str, Exception]]:
    """Stamp the heartbeat of running rows, one statement a table; each table's failure is
    returned (its label and error), not raised: it must not undo what the renewal learned."""
    by_model: dict[type[RunContract], list[object]] = defaultdict(list)
    for row in runs:
        by_model[row.model].append(row.pk)
    failed = []
    for model, pks in by_model.items():
        try:
            model._default_manager.using(using).filter(pk__in=pks, state=RunState.RUNNING).update(
                heartbeat_at=Now()
            )
        except Exception as exc:
            failed.append((model._meta.label, exc))
    return failed


def _ended(row: RunRow, outcome: Outcome, using: str) -> bool:
    """The attempt ended: succeeded, failed (with its code) or queued again for a retry."""
    model, state = row.model, outcome.state
    values: dict[str, object] = {
        "state": state,
        "last_error": outcome.code or "",
        "error_detail": outcome.detail or "",
    }
    if state in TERMINAL_STATES:
        values["finished_at"] = Now()
    retry_in = outcome.delay if outcome.at is None else None
    if state == RunState.QUEUED and retry_in is not None and _has(model, "next_retry_at"):
        values["next_retry_at"] = ExpressionWrapper(
            Now() + timedelta(seconds=retry_in), output_field=DateTimeField()
        )
    rows = model._default_manager.using(using).filter(pk=row.pk, state=RunState.RUNNING)
    return bool(rows.update(**values))


def _has(model: type[RunContract], name: str) -> bool:
    return any(field.name == name for field in model._meta.concrete_fields)


# -- operators' transitions, by the declared bindings ----------------------------------------


def rows_of_jobs(ids: Iterable[int], using: str) -> dict[type[RunContract], list[object]]:
    """The bound rows of these jobs, by model."""
    bound = {b.name: (b.model, b.field) for b in _declared}
    found: dict[type[RunContract], list[object]] = defaultdict(list)
    ids = list(ids)
    if not bound or not ids:
        return found
    with connections[using].cursor() as cur:
        cur.execute(
            "SELECT name, payload FROM jobs_job WHERE id = ANY(%s) AND name = ANY(%s)",
            [ids, list(bound)],
        )
        for name, payload in cur.fetchall():
            model, run_field = bound[name]
            payload = _db.load_json_or_text(payload)
            pk = payload.get(run_field) if isinstance(payload, dict) else None
            if pk is not None:
                found[model].append(pk)
    return found


def replayed(ids: Iterable[int], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Jobs went back to the queue by replay: their finished bound rows are queued again.

    A row whose key a newer active row took meanwhile stays as it is (the domain moved on).
    """
    values = {"state": RunState.QUEUED, "last_error": "", "error_detail": ""}
    for model, pks in rows_of_jobs(ids, using).items():
        extra: dict[str, object] = {
            f: None for f in ("finished_at", "next_retry_at") if _has(model, f)
        }
        if _has(model, "attempts"):
            extra["attempts"] = 0
        for pk in pks:
            try:
                with transaction.atomic(using=using):
                    model._default_manager.using(using).filter(
                        pk=pk, state__in=TERMINAL_STATES
                    ).update(**values, **extra)
            except IntegrityError:
                continue


def cancelled(ids: Iterable[int], *, by: str, using: str = DEFAULT_DB_ALIAS) -> None:
    """Queued jobs were cancelled: their active bound rows are cancelled too."""
    for model, pks in rows_of_jobs(ids, using).items():
        values: dict[str, object] = {
            "state": RunState.CANCELLED,
            "last_error": ErrorCode.CANCELLED,
            "error_detail": f"cancelled by {by}",
        }
        if _has(model, "finished_at"):
            values["finished_at"] = Now()
        model._default_manager.using(using).filter(pk__in=pks, state__in=ACTIVE_STATES).update(
            **values
        )
