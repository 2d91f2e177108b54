"""Held jobs: lease renewal, and the next attempt of a job waited out in the worker.

A worker renews the leases of every job it holds in one statement, every third of the lease
(:func:`renew_leases`), which also carries the handlers' progress reports, the process's beat
and the heartbeat of bound run rows, and tells the worker which leases it lost and which
attempts an operator asked to stop. A short ``RetryAfter`` waited out in the worker counts
its next attempt here first (:func:`next_attempt`), fenced by the claim token.

Both run on the calling thread's connection. A handler thread's connection keeps the
project's plain settings, so the worker asks for ``local_bounds`` there: the statement and
lock bounds (:func:`jobs.db.bounds.local`) then hold for that one call's transaction only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from jobs.core.conf import jobs_settings
from jobs.core.progress import Progress
from jobs.db import bounds as dbbounds
from jobs.queue import _db, attempts, bound, processes, rollup, text
from jobs.queue.bound import RunRows
from jobs.queue.outcomes import report_json
from jobs.queue.types import ClaimedJob, ProcessBeat, Renewal


def renew(
    jobs: Sequence[ClaimedJob],
    *,
    lease: timedelta | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> set[int]:
    """Extend the leases of jobs this worker still holds, in one statement.

    Stamps ``heartbeat_at``. Returns the ids whose lease was lost (token no longer matches or
    the job left ``running``): their handlers must stop and write no outcome. Rows another
    session holds locked are skipped this time, and not reported lost.
    """
    lost = renew_tokens(jobs, lease=lease, using=using)
    return {job.id for job in jobs if job.claim_token in lost}


def renew_tokens(
    jobs: Sequence[ClaimedJob],
    *,
    lease: timedelta | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> set[UUID]:
    """Extend the leases of jobs this worker still holds; returns the lost claim tokens.

    Like :func:`renew`, by token: one worker can briefly hold two claims of one job (its
    stale attempt and a fresh one after the lease expired), and only the stale one is lost.
    """
    return set(renew_leases(jobs, lease=lease, using=using).lost)


def renew_leases(
    jobs: Sequence[ClaimedJob],
    *,
    lease: timedelta | None = None,
    beat: ProcessBeat | None = None,
    progress: Mapping[UUID, Progress] | None = None,
    runs: RunRows | None = None,
    local_bounds: bool = False,
    using: str = DEFAULT_DB_ALIAS,
) -> Renewal:
    """Extend the leases of held jobs and refresh the process's row, in one statement.

    Reports, by claim token, the leases lost and the attempts an operator asked to stop
    (:func:`jobs.queue.cancel`). With no jobs, only the beat is written (an idle worker).
    ``progress`` holds the handlers' reports not written yet (:mod:`jobs.core.progress`), by
    claim token: each goes to its row in the same UPDATE, which stays a HOT update (the
    column is in no index); ``Renewal.unsent`` names those that were not written.

    ``runs`` names the bound run rows of the jobs, by claim token: those of the leases not
    lost get their heartbeat after the renewal (:func:`jobs.queue.bound.beat`; a table whose
    update fails is in ``Renewal.runs_failed``).

    With ``local_bounds`` the statement bounds hold for this call only (see the module
    docstring).
    """
    if local_bounds:
        with dbbounds.local(using):
            return renew_leases(
                jobs, lease=lease, beat=beat, progress=progress, runs=runs, using=using
            )
    if not jobs and beat is None:
        return Renewal()
    reports = [progress.get(job.claim_token) for job in jobs] if progress else []
    # Rows another session has locked (an operator's open transaction) are skipped, not
    # waited for: their renewal waits for the next round, and they are not reported lost
    # (``Renewal.skipped``: their leases run on from the last renewal that wrote them).
    # Rows are found by key: ``state || ''`` keeps the planner off the running index, which,
    # under statistics taken with few rows running, it read whole, every job the fleet holds
    # (as the outcome write did, jobs.queue.outcomes). The comment stays out of the SQL, whose
    # first 1,024 bytes are all pg_stat_activity shows.
    with _db.bound_cursor(using) as cur:
        cur.execute(
            f"""
            WITH held AS (
                -- A NULL array of reports (none to write) reads as NULL for every job.
                SELECT * FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[], %(reports)b::jsonb[])
                    AS l(id, token, report)
            ),
            free AS (
                SELECT j.id, held.token, held.report FROM jobs_job j JOIN held ON j.id = held.id
                WHERE j.claim_token = held.token AND j.state || '' = 'running'
                FOR UPDATE OF j SKIP LOCKED
            ),
            renewed AS (
                UPDATE jobs_job j
                SET lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
                    heartbeat_at = statement_timestamp(),
                    progress = COALESCE(free.report, j.progress)
                FROM free WHERE j.id = free.id
                RETURNING free.token
            ),
            {processes.BEAT_CTE}
            -- (A data-modifying CTE runs whether or not the query reads it.)
            SELECT held.token, j.id IS NULL, j.cancel_requested_at IS NOT NULL, FALSE
            FROM held
            LEFT JOIN jobs_job j
              ON j.id = held.id AND j.claim_token = held.token AND j.state || '' = 'running'
            WHERE j.id IS NULL OR j.cancel_requested_at IS NOT NULL
            -- A beat that found no row: one row with no token says so.
            UNION ALL
            SELECT NULL, FALSE, FALSE, FALSE FROM beat_missed WHERE missed
            -- Held rows not renewed: lost (above), or locked by another session (skipped).
            UNION ALL
            SELECT held.token, FALSE, FALSE, TRUE FROM held
            WHERE NOT EXISTS (SELECT 1 FROM renewed r WHERE r.token = held.token)
            """,
            {
                "ids": [job.id for job in jobs],
                "tokens": [job.claim_token for job in jobs],
                "reports": [None if r is None else report_json(r) for r in reports]
                if any(r is not None for r in reports)
                else None,
                "lease": _db.seconds(lease or jobs_settings.LEASE),
                **processes.beat_params(beat),
            },
        )
        rows = cur.fetchall()
    lost = frozenset(token for token, lost, _, _ in rows if lost)
    unrenewed = frozenset(token for token, _, _, flag in rows if flag)
    kept = [row for token, row in (runs or {}).items() if token not in lost]
    return Renewal(
        lost=lost,
        cancel_requested=frozenset(token for token, lost, asked, _ in rows if asked and not lost),
        beat_missed=any(token is None for token, _, _, _ in rows),
        unsent=unrenewed & frozenset(progress or ()),
        skipped=unrenewed - lost,
        runs_failed=tuple(bound.beat(kept, using=using)) if kept else (),
    )


# An attempt waited out in the worker ended as a retry: the console's history counts it.
_RETRIED = rollup.cte("SELECT name, 'retried', %(code)s, ran, waited FROM bumped")


def next_attempt(
    job: ClaimedJob,
    *,
    lease: timedelta | None = None,
    code: str = "",
    detail: str = "",
    local_bounds: bool = False,
    using: str = DEFAULT_DB_ALIAS,
) -> int | None:
    """Count another attempt of a held job before it runs again in the same claim.

    A short ``RetryAfter`` is waited out in the worker; the attempt after it is recorded
    here, fenced by the claim token and renewing the lease, so a worker that dies during the
    wait cannot let the job run past its ``max_attempts``. The attempt that ended is logged
    as a retry with ``code`` and ``detail``. Returns the job's attempts now, or None when the
    lease was lost or an operator asked the job to stop (the handler must not run again; a
    renewal tells the two apart). ``local_bounds``: as for :func:`renew_leases`.
    """
    if local_bounds:
        with dbbounds.local(using):
            return next_attempt(job, lease=lease, code=code, detail=detail, using=using)
    # The row by key (``state || ''``), as renew_leases finds its rows.
    with _db.bound_cursor(using) as cur:
        cur.execute(
            f"""
            WITH bumped AS (
            UPDATE jobs_job j
            SET attempts = j.attempts + 1,
                lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
                heartbeat_at = statement_timestamp(),
                started_at = statement_timestamp(),
                -- The next attempt is due now: its queue latency is not the wait just done.
                run_after = statement_timestamp(),
                attempt_log = j.attempt_log || {
                attempts.entry_sql(row="j", outcome="'retry'", code="%(code)s", error="%(detail)s")
            }
            -- The row before the update, for the ended attempt's figures in the rollup.
            FROM jobs_job was
            WHERE j.id = %(id)s AND j.claim_token = %(token)s AND j.state || '' = 'running'
              AND j.cancel_requested_at IS NULL AND was.id = j.id
            RETURNING j.attempts, j.name,
                GREATEST(0, EXTRACT(EPOCH FROM statement_timestamp() - was.started_at))::float8
                    AS ran,
                GREATEST(0, EXTRACT(EPOCH FROM was.started_at - was.run_after))::float8 AS waited
            ),
            {_RETRIED}
            SELECT attempts FROM bumped WHERE {rollup.reads()}
            """,
            {
                "id": job.id,
                "token": job.claim_token,
                "lease": _db.seconds(lease or jobs_settings.LEASE),
                "code": text.clean(code)[:32],
                "detail": text.clean(detail),
            },
        )
        row = cur.fetchone()
    return None if row is None else row[0]
