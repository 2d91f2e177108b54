"""The processes table: live ``runworker`` and ``runscheduler`` processes.

A process's row is refreshed by a statement it makes anyway (:data:`BEAT_CTE` rides in the
worker's lease renewal), so a registry of live processes costs no extra commit on a busy
worker. Every clock here is PostgreSQL's::

    start ──register──▶ ready ──(stop signal)──▶ draining ──clean stop: unregister──▶ (no row)
                          │                         │
                          └──── no beat until expires_at (kill -9, host loss, a stall) ──▶ gone
    gone, for PROCESS_RETENTION ──prune_gone (scheduler retention)──▶ (no row)

A process that comes back from a stall beats again and is live again; a row already pruned
stays gone until the process registers anew (the scheduler does at its next beat).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from django.db import DEFAULT_DB_ALIAS

from jobs.core.conf import jobs_settings
from jobs.queue import _db
from jobs.queue.types import ProcessBeat

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from jobs.models import Process

# A CTE for statements that refresh the caller's process row along with their own work.
# A CTE for statements that refresh the caller's process row along with their own work. A
# row another session holds locked (an operator's open transaction) is skipped, never waited
# for: the lease renewal it rides in must not stall on it. ``beat_missed`` is true only when
# the row does not exist at all (pruned during a long stall), not when it was skipped.
BEAT_CTE = """
beat_row AS (
    SELECT identity FROM jobs_process WHERE identity = %(beat_identity)s
    FOR UPDATE SKIP LOCKED
),
beat AS (
    UPDATE jobs_process p
    SET last_seen_at = statement_timestamp(),
        expires_at = statement_timestamp() + make_interval(secs => %(beat_expires_in)s),
        held = %(beat_held)s, draining = %(beat_draining)s, leader = %(beat_leader)s
    FROM beat_row WHERE p.identity = beat_row.identity
    RETURNING 1
),
beat_missed AS (
    SELECT %(beat_identity)s::text IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM beat)
           AND NOT EXISTS (SELECT 1 FROM jobs_process WHERE identity = %(beat_identity)s)
           AS missed
)"""

State = Literal["ready", "draining", "gone"]


def beat_params(beat: ProcessBeat | None) -> dict[str, Any]:
    """The parameters of :data:`BEAT_CTE`; with no beat, an identity that matches no row."""
    if beat is None:
        return {
            "beat_identity": None,
            "beat_held": 0,
            "beat_draining": False,
            "beat_leader": False,
            "beat_expires_in": 0.0,
        }
    return {
        "beat_identity": beat.identity,
        "beat_held": beat.held,
        "beat_draining": beat.draining,
        "beat_leader": beat.leader,
        "beat_expires_in": float(beat.expires_in),
    }


def register(
    identity: str,
    *,
    component: str,
    host: str,
    pid: int,
    version: str,
    expires_in: float,
    scope: str = "",
    concurrency: int | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> None:
    """Insert the caller's row, or replace the row a former process of the same identity left.

    ``expires_in`` (seconds) is how long the row counts as live without a beat.
    """
    with _db.cursor(using) as cur:
        cur.execute(
            """
            INSERT INTO jobs_process AS p (
                identity, component, host, pid, version, scope, concurrency,
                held, draining, leader, started_at, last_seen_at, expires_at
            ) VALUES (
                %(identity)s, %(component)s, %(host)s, %(pid)s, %(version)s, %(scope)s,
                %(concurrency)s, 0, false, false, statement_timestamp(), statement_timestamp(),
                statement_timestamp() + make_interval(secs => %(expires_in)s)
            )
            ON CONFLICT (identity) DO UPDATE SET
                component = EXCLUDED.component, host = EXCLUDED.host, pid = EXCLUDED.pid,
                version = EXCLUDED.version, scope = EXCLUDED.scope,
                concurrency = EXCLUDED.concurrency, held = 0, draining = false, leader = false,
                started_at = EXCLUDED.started_at, last_seen_at = EXCLUDED.last_seen_at,
                expires_at = EXCLUDED.expires_at
            """,
            {
                "identity": identity,
                "component": component,
                "host": host[:200],
                "pid": pid,
                "version": version[:40],
                "scope": scope[:200],
                "concurrency": concurrency,
                "expires_in": float(expires_in),
            },
        )


def beat(beat: ProcessBeat, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Refresh the caller's row on its own (the scheduler); False when it has no row.

    A row another session holds locked is left as it is this time (and reported found).
    """
    with _db.cursor(using) as cur:
        cur.execute(f"WITH {BEAT_CTE} SELECT NOT missed FROM beat_missed", beat_params(beat))
        found: bool = cur.fetchone()[0]
        return found


def unregister(identity: str, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Delete the caller's row on a clean stop; False when there was none."""
    with _db.cursor(using) as cur:
        cur.execute("DELETE FROM jobs_process WHERE identity = %s", [identity])
        deleted: int = cur.rowcount
        return deleted > 0


def prune_gone(
    *,
    older_than: timedelta | None = None,
    limit: int = 1000,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Delete rows gone (``expires_at`` passed) for longer than ``older_than``; how many.

    ``older_than`` defaults to ``JOBS["PROCESS_RETENTION"]``, ``now`` to PostgreSQL's clock.
    """
    age = jobs_settings.PROCESS_RETENTION if older_than is None else older_than
    with _db.cursor(using) as cur:
        cur.execute(
            """
            DELETE FROM jobs_process WHERE identity = ANY(ARRAY(
                SELECT identity FROM jobs_process
                WHERE expires_at < COALESCE(%(now)s::timestamptz, statement_timestamp())
                                   - make_interval(secs => %(age)s)
                ORDER BY expires_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ))
            """,
            {"now": now, "age": _db.seconds(age), "limit": limit},
        )
        deleted: int = cur.rowcount
        return deleted


@dataclass(frozen=True, slots=True)
class HeldJob:
    """A running job claimed by a process, as its row says now."""

    id: int
    job_id: str
    name: str
    tenant: str
    attempts: int
    started_at: datetime | None
    elapsed: float | None  # seconds since the claim, by PostgreSQL's clock
    progress: Any = None  # the handler's last report as stored (jobs.core.progress.read)


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    """One row of ``jobs_process`` with what the database clock says of it."""

    identity: str
    component: str
    host: str
    pid: int
    version: str
    scope: str
    concurrency: int | None
    held: int
    draining: bool
    leader: bool
    started_at: datetime
    last_seen_at: datetime
    expires_at: datetime
    gone: bool  # no beat before expires_at: the process died, stalled or lost the database
    seen_ago: float  # seconds since the last beat
    jobs: tuple[HeldJob, ...] = ()  # running jobs whose claim names this process

    @property
    def state(self) -> State:
        if self.gone:
            return "gone"
        return "draining" if self.draining else "ready"

    @property
    def free(self) -> int | None:
        """Free slots of a live worker that claims; None for schedulers."""
        if self.concurrency is None:
            return None
        if self.gone or self.draining:
            return 0
        return max(0, self.concurrency - self.held)


_STATUS_FIELDS = (*(f.name for f in fields(ProcessStatus)),)[:-1]  # all but jobs
_PROCESS_COLUMNS = (
    "identity, component, host, pid, version, scope, concurrency, held, draining, leader, "
    "started_at, last_seen_at, expires_at"
)


def status(
    identity: str | None = None, *, with_jobs: bool = True, using: str = DEFAULT_DB_ALIAS
) -> list[ProcessStatus]:
    """Every registered process (or one), live and gone, with the running jobs each holds.

    Held jobs come from the jobs table (``state = 'running'``, ``claimed_by``) through its
    index of running rows, in the same statement: one snapshot, one clock.
    """
    jobs_sql = (
        """
        SELECT j.claimed_by, json_agg(json_build_array(
                   j.id, j.job_id, j.name, j.tenant, j.attempts,
                   EXTRACT(EPOCH FROM j.started_at)::float8,
                   EXTRACT(EPOCH FROM statement_timestamp() - j.started_at)::float8,
                   j.progress
               ) ORDER BY j.started_at, j.id) AS jobs
        FROM jobs_job j
        WHERE j.state = 'running' AND j.claimed_by IN (SELECT identity FROM p)
        GROUP BY j.claimed_by
        """
        if with_jobs
        else "SELECT NULL::text AS claimed_by, NULL::json AS jobs WHERE false"
    )
    with _db.cursor(using) as cur:
        cur.execute(
            f"""
            WITH p AS (
                SELECT {_PROCESS_COLUMNS},
                       expires_at < statement_timestamp() AS gone,
                       GREATEST(0, EXTRACT(EPOCH FROM statement_timestamp() - last_seen_at)
                       )::float8 AS seen_ago
                FROM jobs_process
                WHERE %(identity)s::text IS NULL OR identity = %(identity)s
            ),
            held AS ({jobs_sql})
            SELECT p.*, held.jobs FROM p LEFT JOIN held ON held.claimed_by = p.identity
            ORDER BY p.component DESC, p.host, p.started_at, p.identity
            """,
            {"identity": identity},
        )
        rows = cur.fetchall()
    return [
        ProcessStatus(**dict(zip(_STATUS_FIELDS, row[:-1], strict=True)), jobs=_held_jobs(row[-1]))
        for row in rows
    ]


def _held_jobs(value: Any) -> tuple[HeldJob, ...]:
    if value is None:
        return ()
    jobs = []
    for id_, job_id, name, tenant, attempts, started, elapsed, progress in _db.load_json(value):
        started_at = None if started is None else datetime.fromtimestamp(started, UTC)
        jobs.append(HeldJob(id_, job_id, name, tenant, attempts, started_at, elapsed, progress))
    return tuple(jobs)


class Capacity(NamedTuple):
    """Live workers and the slots they would claim into now (draining ones have none)."""

    workers: int  # live worker processes, draining ones included
    free: int  # free slots of the live workers that claim
    draining: int  # of ``workers``, how many are draining


def capacity(*, using: str = DEFAULT_DB_ALIAS) -> Capacity:
    """The overview's figures, from each live worker's last beat (at most a lease third old)."""
    with _db.cursor(using) as cur:
        cur.execute(
            """
            SELECT count(*)::int,
                   COALESCE(sum(GREATEST(concurrency - held, 0)) FILTER (WHERE NOT draining),
                            0)::int,
                   count(*) FILTER (WHERE draining)::int
            FROM jobs_process
            WHERE component = 'worker' AND expires_at >= statement_timestamp()
            """
        )
        workers, free, draining = cur.fetchone()
    return Capacity(workers, free, draining)


def listing(*, using: str = DEFAULT_DB_ALIAS) -> QuerySet[Process]:
    """The rows as a queryset for the admin's list, with ``gone`` and ``seen_ago`` annotated.

    Both are judged by PostgreSQL's clock (``Now()`` is ``statement_timestamp()``), as every
    beat is written by it, so a web host with a skewed clock shows the same states.
    """
    from django.db.models import BooleanField, ExpressionWrapper, F, Q
    from django.db.models.functions import Now

    from jobs.models import Process

    return Process.objects.using(using).annotate(
        gone=ExpressionWrapper(Q(expires_at__lt=Now()), output_field=BooleanField()),
        seen_ago=Now() - F("last_seen_at"),
    )
