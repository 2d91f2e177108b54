"""Every attempt of a job: the earlier ones in the row's log, the last one in its columns.

A job's latest attempt is described by the row itself (``started_at``, ``finished_at``,
``claimed_by``, ``state``, ``last_error``, ``error_detail``) until another attempt replaces
it. So the statements that end an attempt *without* ending the job (a retry, the next
in-process attempt, an expired lease that requeues it) append that attempt to
``attempt_log`` in the same statement, and a replay appends the run's last attempt before it
clears the columns; an attempt that ends the job writes nothing more. The common job, run
once, costs no extra byte, and the log moves to the history table and is pruned with its job,
as Oban's ``errors`` and River's ``errors``/``attempted_by`` do. An entry::

    {"attempt": 2, "started_at": "…", "ended_at": "…", "worker": "host:pid:nonce",
     "outcome": "retry", "code": "handler_error", "error": "Traceback …"}

``outcome`` is ``retry`` (back to the queue), ``lease_expired`` (nobody reported: the worker
died or stalled) or, for the run before a replay, the state it ended in. ``code`` and
``error`` are left out when empty; ``error`` keeps the last :data:`ERROR_MAX` characters.
A hand-back by a draining worker is not an attempt and writes no entry. :func:`of` reads
both halves back as one list.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime

#: Characters of error text an entry keeps (the end of it: a traceback's last lines say most).
ERROR_MAX = 2000


def entry_sql(
    *, row: str, outcome: str, code: str, error: str, ended: str = "statement_timestamp()"
) -> str:
    """A JSON array of one entry for the attempt ``row`` holds, ending at ``ended``.

    ``row`` is the jobs table's alias as it was before the statement (its ``attempts``,
    ``started_at`` and ``claimed_by`` describe the attempt that is ending); the others are
    SQL expressions.
    """
    return f"""jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
        'attempt', {row}.attempts, 'started_at', {row}.started_at,
        'ended_at', {ended}, 'worker', NULLIF({row}.claimed_by, ''),
        'outcome', {outcome}, 'code', NULLIF({code}, ''),
        'error', NULLIF(right({error}, {ERROR_MAX}), ''))))"""


def unlogged_last_sql(row: str) -> str:
    """True when ``row``'s latest attempt is in its columns only, not yet in its log."""
    return (
        f"({row}.attempts > 0 AND {row}.started_at IS NOT NULL AND NOT COALESCE("
        f"({row}.attempt_log -> -1 ->> 'ended_at')::timestamptz > {row}.started_at, FALSE))"
    )


@dataclass(frozen=True, slots=True)
class Attempt:
    """One finished attempt of a job, read back from its log."""

    attempt: int
    started_at: datetime | None
    ended_at: datetime | None
    worker: str
    outcome: str
    code: str
    error: str

    @property
    def duration(self) -> float | None:
        """Seconds from start to end, when both are known."""
        if self.started_at is None or self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


def of(job: Any) -> list[Attempt]:
    """Every attempt of a job row (a ``Job`` or ``JobHistory``), oldest first.

    The log's entries, then the latest attempt from the row's columns unless the log holds
    it already (its last entry ended after the latest attempt started). A running job's
    current attempt has no end and the outcome ``running``; a queued job's attempts are all in
    the log (going back to the queue logs the attempt; a hand-back was none).
    """
    attempts = read(job.attempt_log)
    started = job.started_at
    if job.state == "queued" or job.attempts <= 0 or started is None:
        return attempts
    if attempts and attempts[-1].ended_at is not None and attempts[-1].ended_at > started:
        return attempts
    finished = job.state not in ("queued", "running")
    attempts.append(
        Attempt(
            attempt=job.attempts,
            started_at=started,
            ended_at=job.finished_at if finished else None,
            worker=job.claimed_by or "",
            outcome=job.state if finished else "running",
            code=job.last_error if finished and job.state != "succeeded" else "",
            error=job.error_detail if finished and job.state != "succeeded" else "",
        )
    )
    return attempts


def read(log: Any) -> list[Attempt]:
    """The entries of an ``attempt_log`` value, oldest first; malformed entries are skipped."""
    if not isinstance(log, list):
        return []
    attempts = []
    for entry in log:
        if not isinstance(entry, dict):
            continue
        try:
            attempts.append(
                Attempt(
                    attempt=int(entry.get("attempt", 0)),
                    started_at=_when(entry.get("started_at")),
                    ended_at=_when(entry.get("ended_at")),
                    worker=str(entry.get("worker") or ""),
                    outcome=str(entry.get("outcome") or ""),
                    code=str(entry.get("code") or ""),
                    error=str(entry.get("error") or ""),
                )
            )
        except (TypeError, ValueError):
            continue
    return attempts


def _when(value: Any) -> datetime | None:
    return parse_datetime(value) if isinstance(value, str) else None
