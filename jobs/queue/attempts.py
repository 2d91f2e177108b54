"""The attempt log: one JSON entry per finished attempt, kept in the job's row.

Every statement that ends an attempt (an outcome write, the next in-process attempt, a lease
that expired) appends the entry in the same statement, so the history costs no commit of its
own; it moves to the history table and is pruned with its job, as Oban's ``errors`` and
River's ``errors``/``attempted_by`` do. An entry::

    {"attempt": 2, "started_at": "…", "ended_at": "…", "worker": "host:pid",
     "outcome": "retry", "code": "handler_error", "error": "Traceback …"}

``outcome`` is ``succeeded``, ``failed``, ``cancelled``, ``retry`` (the job went back to the
queue) or ``lease_expired`` (nobody reported: the worker died or stalled). ``code`` and
``error`` are left out when empty; ``error`` keeps the last :data:`ERROR_MAX` characters.
A hand-back by a draining worker is not an attempt and writes no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime

#: Characters of error text an entry keeps (the end of it: a traceback's last lines say most).
ERROR_MAX = 2000


def entry_sql(*, row: str, outcome: str, code: str, error: str) -> str:
    """A JSON array of one entry for the attempt ``row`` holds, as of this statement.

    ``row`` is the jobs table's alias as it was before the statement (its ``attempts``,
    ``started_at`` and ``claimed_by`` describe the attempt that is ending); the others are
    SQL expressions.
    """
    return f"""jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
        'attempt', {row}.attempts, 'started_at', {row}.started_at,
        'ended_at', statement_timestamp(), 'worker', NULLIF({row}.claimed_by, ''),
        'outcome', {outcome}, 'code', NULLIF({code}, ''),
        'error', NULLIF(right({error}, {ERROR_MAX}), ''))))"""


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
