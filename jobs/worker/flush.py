"""Writing outcomes when the database refuses a batch: one by one, failing only the offender.

The run loop writes a pass's outcomes in one statement. If PostgreSQL refuses it (a value a
trigger or constraint rejects), every outcome is written again in its own transaction, and
the one still refused becomes a ``failed`` / ``handler_error`` outcome whose detail carries
the database's message; if even that is refused, the job is given up to its lease. A
deadlock or serialization failure is not a refusal: that outcome is tried again, and put
off to the next pass if the conflict persists.
"""

from __future__ import annotations

import logging
from uuid import UUID

from django.db import Error as DjangoDbError
from django.db import transaction

from jobs import queue
from jobs.queue import Outcome, OutcomeReport
from jobs.runs import ErrorCode
from jobs.worker.execution import Running, sync_run_rows

logger = logging.getLogger("jobs.worker")


def write_one_by_one(
    outcomes: list[tuple[Running, Outcome]],
) -> tuple[OutcomeReport, list[tuple[Running, Outcome]]]:
    """Each outcome in its own transaction; one the database refuses becomes a failure.

    Returns the report and the outcomes as written (a refused one replaced).
    """
    results: dict[str, list[int]] = {"applied": [], "fenced": [], "busy": []}
    tokens: dict[str, set[UUID]] = {"applied": set(), "fenced": set(), "busy": set()}
    written: list[tuple[Running, Outcome]] = []
    for running, outcome in outcomes:
        job = running.job
        try:
            result = _write_one_retrying(running, outcome)
        except Exception as exc:  # refused by the database, or a bug in a run-row update
            if unreachable(exc):
                raise
            logger.error(
                "the database refused the outcome of job %s (%s): %s; failing the job",
                job.job_id,
                job.name,
                one_line(exc),
                extra={"job_id": job.job_id, "job_type": job.name, "action": "refused"},
            )
            outcome = Outcome.failed(
                job,
                code=ErrorCode.HANDLER_ERROR,
                detail=f"the database refused this attempt's outcome ({outcome.state}): "
                f"{one_line(exc)}",
            )
            try:
                result = _write_one(running, outcome)
            except Exception as again:
                if unreachable(again):
                    raise
                # Not even the failure could be stored: let the lease expire.
                logger.error("could not fail job %s either: %s", job.job_id, again)
                running.lost = True
                continue
        results[result].append(job.id)
        tokens[result].add(outcome.token)
        written.append((running, outcome))
    report = OutcomeReport(
        applied=tuple(results["applied"]),
        fenced=tuple(results["fenced"]),
        busy=tuple(results["busy"]),
        applied_tokens=frozenset(tokens["applied"]),
        busy_tokens=frozenset(tokens["busy"]),
    )
    return report, written


#: Times one outcome is written again after a deadlock or serialization failure before it is
#: put off to the next pass.
TRANSIENT_RETRIES = 3


def _write_one_retrying(running: Running, outcome: Outcome) -> str:
    """:func:`_write_one`, again after a transient refusal; ``busy`` if it keeps coming.

    A deadlock (two outcome statements that took batch or dependent rows in opposite orders:
    PostgreSQL aborts one) says nothing about the outcome: it must never become a failure.
    """
    for attempt in range(1, TRANSIENT_RETRIES + 1):
        try:
            return _write_one(running, outcome)
        except DjangoDbError as exc:
            if not transient(exc):
                raise
            if attempt == TRANSIENT_RETRIES:
                logger.warning(
                    "the outcome of job %s (%s) met %s %d times; trying in the next pass",
                    running.job.job_id,
                    running.job.name,
                    one_line(exc),
                    attempt,
                    extra={"job_id": running.job.job_id, "action": "outcome_deferred"},
                )
    return "busy"  # put off: the pass defers busy outcomes to the next one


def _write_one(running: Running, outcome: Outcome) -> str:
    """``applied``, ``fenced`` or ``busy`` (the row is locked by another session)."""
    using = running.ctx.using
    with transaction.atomic(using=using):
        report = queue.record([outcome], using=using)
        if report.applied:
            sync_run_rows([(running, report.as_written(outcome))])
    return "applied" if report.applied else "busy" if report.busy else "fenced"


# SQLSTATEs that mean the server or the path to it is gone, not that a statement was refused:
# connection exceptions (class 08) and the server shutting down or crashing (57P01-57P03).
_UNREACHABLE = ("08", "57P01", "57P02", "57P03")


def refused_data(exc: BaseException) -> bool:
    """True when the database refused a statement, rather than being unreachable.

    Judged by SQLSTATE, not by exception class: psycopg files a lock timeout (55P03), a
    statement timeout (57014) or a value over a limit (class 54) under OperationalError too,
    and each of those concerns one statement, not the connection. An error without a
    SQLSTATE (a failed connect, a broken socket) means the database is unreachable.
    """
    cause = exc.__cause__ if isinstance(exc, DjangoDbError) else exc
    sqlstate = getattr(cause, "sqlstate", None)
    if not sqlstate:
        return False
    return not sqlstate.startswith(_UNREACHABLE)


#: SQLSTATEs of a transaction PostgreSQL rolled back for a conflict with another one (a
#: serialization failure, a deadlock): the same statement succeeds when tried again.
_TRANSIENT = ("40001", "40P01")


def transient(exc: BaseException) -> bool:
    """True for a statement aborted by a conflict with another transaction (try it again)."""
    cause = exc.__cause__ if isinstance(exc, DjangoDbError) else exc
    return getattr(cause, "sqlstate", None) in _TRANSIENT


def unreachable(exc: BaseException) -> bool:
    """A database error that says the database cannot be reached (retry the whole pass)."""
    return isinstance(exc, DjangoDbError) and not refused_data(exc)


def one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
