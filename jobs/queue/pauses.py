"""The pauses table: job types, queues and tenants no worker claims from until resumed, and
schedules the scheduler fires no slot of (:mod:`jobs.scheduler.pausing` reads and resumes those).

The claim reads the table in its own statement (:data:`PAUSED_CTE`), so a pause holds on
every worker of every host from the moment it commits, and a worker keeps no pause state in
memory. A paused job type drops out of the claim's requests before any row is read; a paused
queue or tenant is a filter on the rows a claim reads (docs/operator-controls.md says what
that costs when the paused rows lie ahead of the ones that may run). Paused jobs stay ``queued``:
their backlog is visible and keeps growing, and jobs already running finish normally.
Resuming notifies the workers that run the affected job types, so idle ones claim at once.
The claim ignores schedule pauses, and resuming a schedule notifies nobody.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, transaction

from jobs.core.conf import NOTIFY_CHANNEL, jobs_settings
from jobs.core.limits import validate_key
from jobs.models import PauseKind
from jobs.queue import _db, text

# The claim's view of the table: what is paused, read once per claim statement. Empty arrays
# when nothing is (``x <> ALL('{}')`` holds for every x).
PAUSED_CTE = """
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
)"""
#: The filter a claim applies to the rows it reads (``j`` is the jobs table). It compares an
#: expression (``|| ''``), not the column: the planner cannot see the array, and with the
#: column's statistics a queue column holding one value would make it expect no row to pass,
#: and read and sort a type's whole backlog instead of walking the claim index (25 ms
#: instead of 0.7 ms for 10 of 100,000 jobs, bench/pause_claim.py).
PAUSED_ROWS = " AND ".join(
    f"NOT (j.{column} || '' = ANY((SELECT {array} FROM paused)::text[]))"
    for column, array in (("queue", "queues"), ("tenant", "tenants"))
)
#: The filter a claim applies to the job types it is asked for (``w.name``).
PAUSED_NAMES = "w.name <> ALL((SELECT names FROM paused)::text[])"

VALUE_MAX = 200


@dataclass(frozen=True, slots=True)
class PauseRow:
    kind: str
    value: str
    reason: str
    paused_at: datetime
    paused_by: str
    until: datetime | None = None  # a timed pause (a throttle) ends by itself then


def validate(kind: str, value: str) -> None:
    """Raise ValueError for a kind that is not one of :class:`~jobs.models.PauseKind`'s, or a
    name no job could carry (a pause that would pause nothing).

    Queues, tenants and schedules follow the rules enqueue and schedules have for their names;
    a job type name is at most 200 characters with no space at either end (a pasted name with
    a trailing space would otherwise report "paused" and pause nothing).
    """
    if kind not in PauseKind.values:
        raise ValueError(f"cannot pause a {kind!r}: pause a {', '.join(PauseKind.values)}")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"name the {kind} to pause")
    if kind in (PauseKind.QUEUE, PauseKind.TENANT, PauseKind.SCHEDULE):
        validate_key(value, f"a {kind} name")
        return
    if len(value) > VALUE_MAX:
        raise ValueError(f"a {kind} name has at most {VALUE_MAX} characters")
    if value != value.strip():
        raise ValueError(f"a {kind} name does not start or end with a space, got {value!r}")
    if (why := text.problem(value)) is not None:
        raise ValueError(f"the {kind} name {why}")


def pause(
    kind: str, value: str, *, by: str, reason: str = "", using: str = DEFAULT_DB_ALIAS
) -> bool:
    """Pause a job type, queue, tenant or schedule; False when it was paused already.

    A throttle in force (a timed pause) becomes this pause, which lasts until resumed.
    """
    validate(kind, value)
    with _db.cursor(using) as cur:
        cur.execute(
            """
            INSERT INTO jobs_pause (kind, value, reason, paused_by)
            VALUES (%(kind)s, %(value)s, %(reason)s, %(by)s)
            -- An operator's pause replaces a throttle's timed one: it lasts until resumed.
            ON CONFLICT (kind, value) DO UPDATE
            SET until = NULL, reason = EXCLUDED.reason, paused_by = EXCLUDED.paused_by,
                paused_at = statement_timestamp()
            WHERE jobs_pause.until IS NOT NULL
            RETURNING 1
            """,
            {"kind": kind, "value": value, "reason": text.clean(reason)[:200], "by": by[:150]},
        )
        return cur.fetchone() is not None


#: Who a throttle's pause is recorded as paused by.
THROTTLED_BY = "throttle"


def throttle(
    name: str, seconds: float, *, reason: str = "", using: str = DEFAULT_DB_ALIAS
) -> datetime | None:
    """Pause a job type for ``seconds`` (a handler's upstream said to slow down); the end.

    A throttle only ever lengthens a timed pause, and never shortens or ends an operator's
    pause (which has no end): the result is None then. Workers of the type claim again when
    the pause ends, at their next poll.
    """
    validate(PauseKind.JOB_TYPE, name)
    with _db.cursor(using) as cur:
        cur.execute(
            """
            INSERT INTO jobs_pause (kind, value, reason, paused_by, until)
            VALUES ('job_type', %(name)s, %(reason)s, %(by)s,
                    statement_timestamp() + make_interval(secs => %(seconds)s))
            ON CONFLICT (kind, value) DO UPDATE
            SET until = EXCLUDED.until, reason = EXCLUDED.reason,
                paused_by = EXCLUDED.paused_by,
                paused_at = CASE WHEN jobs_pause.until > statement_timestamp()
                                 THEN jobs_pause.paused_at ELSE statement_timestamp() END
            WHERE jobs_pause.until IS NOT NULL
              AND (jobs_pause.until < EXCLUDED.until)
            RETURNING until
            """,
            {
                "name": name,
                "reason": text.clean(reason)[:200],
                "by": THROTTLED_BY,
                "seconds": max(0.0, min(float(seconds), 30 * 86400.0)),
            },
        )
        row = cur.fetchone()
    return None if row is None else row[0]


# Queued job types, one hop down the claim index each (a loose index scan): the names a
# resumed queue or tenant may have work for, without reading its backlog.
_WAKE = f"""
WITH RECURSIVE names(name) AS (
    (SELECT j.name FROM jobs_job j WHERE j.state = 'queued' ORDER BY j.name LIMIT 1)
    UNION ALL
    SELECT (SELECT j.name FROM jobs_job j WHERE j.state = 'queued' AND j.name > n.name
            ORDER BY j.name LIMIT 1)
    FROM names n WHERE n.name IS NOT NULL
)
SELECT count(pg_notify('{NOTIFY_CHANNEL}', name)) FROM names WHERE name IS NOT NULL
"""


def resume(kind: str, value: str, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Resume a paused job type, queue, tenant or schedule; False when it was not paused.

    Idle workers of the affected job types are notified when the deletion commits. A schedule
    is resumed by :func:`jobs.scheduler.pausing.resume`, which calls this and records the
    slots that came due while it was paused.
    """
    validate(kind, value)
    with transaction.atomic(using=using), _db.cursor(using) as cur:
        cur.execute(
            # A throttle that has ended paused nothing any more: deleting it resumes nothing.
            "DELETE FROM jobs_pause WHERE kind = %(kind)s AND value = %(value)s "
            "RETURNING until IS NULL OR until > statement_timestamp()",
            {"kind": kind, "value": value},
        )
        row = cur.fetchone()
        resumed = row is not None and bool(row[0])
        if resumed and jobs_settings.NOTIFY:
            if kind == PauseKind.JOB_TYPE:
                cur.execute(f"SELECT pg_notify('{NOTIFY_CHANNEL}', %s)", [value])
            elif kind != PauseKind.SCHEDULE:  # a schedule's resume wakes no worker
                cur.execute(_WAKE)
    return resumed


def paused(*, using: str = DEFAULT_DB_ALIAS) -> list[PauseRow]:
    """Every pause, oldest first."""
    with _db.cursor(using) as cur:
        cur.execute(
            "SELECT kind, value, reason, paused_at, paused_by, until FROM jobs_pause "
            "WHERE until IS NULL OR until > statement_timestamp() ORDER BY paused_at, id"
        )
        return [PauseRow(*row) for row in cur.fetchall()]


def paused_values(
    kind: str, *, lock: bool = False, using: str = DEFAULT_DB_ALIAS
) -> dict[str, datetime]:
    """The names of one kind that are paused, each with when its pause began (one query).

    The scheduler reads the paused schedules once per tick this way. ``lock`` holds the rows
    (``FOR UPDATE``) until the caller's transaction ends.
    """
    with _db.cursor(using) as cur:
        cur.execute(
            "SELECT value, paused_at FROM jobs_pause WHERE kind = %s"
            + (" FOR UPDATE" if lock else ""),
            [kind],
        )
        return dict(cur.fetchall())
