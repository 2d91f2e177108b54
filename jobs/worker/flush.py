"""Writing outcomes when the pass statement fails: one by one, failing only a refused one.

The run loop writes a pass's outcomes in one statement. If it fails, every outcome is written
again in its own transaction, with a short lock wait (:data:`LOCK_WAIT`). What happens to one
that still fails depends on why:

* a **data error** (SQLSTATE class 22, 23 or 54: a value a user's trigger or a constraint
  rejects, or a limit it passes; or an exception a user's trigger raises, P0001) is the
  database refusing this outcome: it becomes a ``failed`` / ``handler_error`` outcome whose
  detail carries the database's message (and if even that is refused, the job is given up
  to its lease);
* anything else, a lock or statement timeout, a deadlock, a serialization failure, is
  **contention**, never a verdict on the job: the outcome is deferred (``busy``), its lease
  kept renewed, and written alone, away from the pass statement, until the lock is gone.
"""

from __future__ import annotations

import logging
from uuid import UUID

from django.db import Error as DjangoDbError

from jobs import queue
from jobs.db.sqlstate import one_line, refused_data, transient, unreachable
from jobs.queue import Outcome, OutcomeReport
from jobs.runs import ErrorCode
from jobs.worker.execution import Running, run_rows

logger = logging.getLogger("jobs.worker")


#: How long one outcome written alone waits for a lock (seconds) before it is deferred. Short:
#: the lock that made the pass statement fail may still be held, and the other outcomes and
#: the next claim must not wait for it.
LOCK_WAIT = 0.05


def write_one_by_one(
    outcomes: list[tuple[Running, Outcome]],
) -> tuple[OutcomeReport, list[tuple[Running, Outcome]]]:
    """Each outcome in its own transaction; one the database refuses becomes a failure, one
    that meets contention is reported busy (and marked ``contended``).

    Returns the report and the outcomes as written (a refused one replaced).
    """
    results: dict[str, list[int]] = {"applied": [], "fenced": [], "busy": []}
    tokens: dict[str, set[UUID]] = {"applied": set(), "fenced": set(), "busy": set()}
    written: list[tuple[Running, Outcome]] = []
    for running, outcome in outcomes:
        result, outcome = _write_or_fail(running, outcome)
        if result is None:
            continue
        results[result].append(running.job.id)
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


def _write_or_fail(running: Running, outcome: Outcome) -> tuple[str | None, Outcome]:
    """Write ``outcome``; if the database refuses its data, write a failure instead.

    Returns what happened (None: not even the failure could be stored, and the job is given
    up to its lease) and the outcome it happened to. Raises when the database is unreachable.
    """
    job = running.job
    try:
        return _write_one_retrying(running, outcome), outcome
    except Exception as exc:  # refused by the database, or a bug in a run-row update
        if unreachable(exc):
            raise
        if isinstance(exc, DjangoDbError) and not refused_data(exc):
            return _contended(running, exc), outcome
        refusal = one_line(exc)
    logger.error(
        "the database refused the outcome of job %s (%s): %s; failing the job",
        job.job_id,
        job.name,
        refusal,
        extra={"job_id": job.job_id, "job_type": job.name, "action": "refused"},
    )
    failure = Outcome.failed(
        job,
        code=ErrorCode.HANDLER_ERROR,
        detail=f"the database refused this attempt's outcome ({outcome.state}): {refusal}",
    )
    try:
        return _write_one_retrying(running, failure), failure
    except Exception as again:
        if unreachable(again):
            raise
        if isinstance(again, DjangoDbError) and not refused_data(again):
            return _contended(running, again), failure
        # Not even the failure could be stored: let the lease expire.
        logger.error("could not fail job %s either: %s", job.job_id, again)
        running.lost = True
        return None, failure


def _contended(running: Running, exc: BaseException) -> str:
    """An outcome that met contention (a lock or statement timeout): deferred, and from now
    on written alone (:func:`write_one_by_one`), not in the pass statement it held up."""
    first = not running.contended
    running.contended = True
    logger.log(
        logging.WARNING if first else logging.DEBUG,
        "the outcome of job %s (%s) met %s; deferred, its lease kept",
        running.job.job_id,
        running.job.name,
        one_line(exc),
        extra={"job_id": running.job.job_id, "action": "outcome_deferred"},
    )
    return "busy"


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
    report = queue.record(
        [outcome], lock_wait=LOCK_WAIT, runs=run_rows([running]), using=running.ctx.using
    )
    return "applied" if report.applied else "busy" if report.busy else "fenced"
