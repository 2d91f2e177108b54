"""Writing outcomes when the database refuses a batch: one by one, failing only the offender.

The run loop writes a pass's outcomes in one statement. If PostgreSQL refuses it (a value a
trigger or constraint rejects), every outcome is written again in its own transaction, and
the one still refused becomes a ``failed`` / ``handler_error`` outcome whose detail carries
the database's message; if even that is refused, the job is given up to its lease.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, InterfaceError, OperationalError, transaction

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
    applied: list[int] = []
    fenced: list[int] = []
    written: list[tuple[Running, Outcome]] = []
    for running, outcome in outcomes:
        job = running.job
        try:
            ok = _write_one(running, outcome)
        except DatabaseError as exc:
            if not refused_data(exc):
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
                ok = _write_one(running, outcome)
            except DatabaseError as again:
                if not refused_data(again):
                    raise
                # Not even the failure could be stored: let the lease expire.
                logger.error("could not fail job %s either: %s", job.job_id, again)
                running.lost = True
                continue
        (applied if ok else fenced).append(job.id)
        written.append((running, outcome))
    return OutcomeReport(tuple(applied), tuple(fenced)), written


def _write_one(running: Running, outcome: Outcome) -> bool:
    with transaction.atomic():
        report = queue.record([outcome])
        if report.applied:
            sync_run_rows([(running, outcome)])
    return bool(report.applied)


def refused_data(exc: DatabaseError) -> bool:
    """True when the database refused what was sent, rather than being unreachable."""
    return not isinstance(exc, OperationalError | InterfaceError)


def one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
