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

The bindings come from the process's registry (``get_registry()``): a process that does not
register a type does not move its rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models.functions import Now

from jobs.queue import _db
from jobs.runs import ACTIVE_STATES, TERMINAL_STATES, ErrorCode, RunContract, RunState
from jobs.runs import _has as has_field


def bindings(model: type[RunContract]) -> list[tuple[str, str]]:
    """(job type name, payload field) of every registered type bound to ``model``."""
    from jobs.catalogue.registry import get_registry

    return [
        (name, job_type.policy.run_field)
        for name in get_registry().names()
        if (job_type := get_registry()[name]).policy.run_model is model
    ]


def rows_of_jobs(ids: Iterable[int], using: str) -> dict[type[RunContract], list[object]]:
    """The bound rows of these jobs, by model."""
    from jobs.catalogue.registry import get_registry

    registry = get_registry()
    bound: dict[str, tuple[type[RunContract], str]] = {}  # name -> (run model, payload field)
    for name in registry.names():
        policy = registry[name].policy
        if policy.run_model is not None:
            bound[name] = (policy.run_model, policy.run_field)
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
            f: None for f in ("finished_at", "next_retry_at") if has_field(model, f)
        }
        if has_field(model, "attempts"):
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
        if has_field(model, "finished_at"):
            values["finished_at"] = Now()
        model._default_manager.using(using).filter(pk__in=pks, state__in=ACTIVE_STATES).update(
            **values
        )
