"""Maintenance passes over the jobs table: expired leases, exhaustion, retention, backlog.

Each pass is one bounded, set-based statement that skips rows another pass has locked, so any
number of workers and the scheduler can run them at once. ``now`` defaults to PostgreSQL's
clock; tests pass it to put rows on either side of a cutoff.

Expired leases (a worker died or stalled)::

    running, lease expired, attempts left ──requeue_expired──▶ queued (due now)
    running, lease expired, last attempt  ──fail_exhausted───▶ failed / lease_expired
    queued, attempts ≥ limit (lowered)    ──fail_exhausted───▶ failed / attempts_exhausted
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from jobs.conf import jobs_settings
from jobs.queue import _db
from jobs.queue.types import AllTenants, BacklogRow, Scope, SweepRow
from jobs.runs import ErrorCode, RunState

_NOW = "COALESCE(%(now)s::timestamptz, statement_timestamp())"


def requeue_expired(
    *,
    scope: Scope | None = None,
    limit: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[SweepRow]:
    """Return running jobs whose lease expired, with attempts left, to the queue (due now).

    Their old claim token is cleared, so the stalled worker's late outcome is fenced out.
    """
    scope_sql, scope_params = (scope or AllTenants()).sql("j")
    return _sweep(
        f"""
        WITH expired AS (
            SELECT j.id FROM jobs_job j
            WHERE j.state = 'running' AND j.lease_expires_at < {_NOW}
              AND j.attempts < j.max_attempts AND {scope_sql}
            ORDER BY j.lease_expires_at
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs_job j
        SET state = 'queued', run_after = {_NOW}, last_error = %(code)s,
            error_detail = 'lease expired while held by ' || j.claimed_by,
            claim_token = NULL, lease_expires_at = NULL, claimed_by = ''
        FROM expired WHERE j.id = expired.id
        RETURNING j.id, j.job_id, j.name, j.tenant, j.state, j.last_error
        """,
        {"limit": limit, "now": now, "code": ErrorCode.LEASE_EXPIRED, **scope_params},
        using,
    )


def fail_exhausted(
    *,
    scope: Scope | None = None,
    max_attempts: Mapping[str, int] | None = None,
    limit: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[SweepRow]:
    """Fail jobs that have no attempt left; claims never pick them.

    A running job whose lease expired on its last attempt fails as ``lease_expired``; a
    queued job at or over its limit (lowered since it was enqueued: pass the types' current
    limits as ``max_attempts``) fails as ``attempts_exhausted``.
    """
    sql, params = fail_exhausted_sql(scope=scope, max_attempts=max_attempts, limit=limit, now=now)
    return _sweep(sql, params, using)


def fail_exhausted_sql(
    *,
    scope: Scope | None = None,
    max_attempts: Mapping[str, int] | None = None,
    limit: int = 100,
    now: datetime | None = None,
) -> tuple[str, dict[str, Any]]:
    """The exhaustion statement and its parameters (also used for EXPLAIN).

    Candidates come from three small sets, each through its own index, never from the fresh
    backlog: running rows (``jobs_job_running``), queued rows over their own limit
    (``jobs_job_out_of_attempts``), and queued retries at a lowered limit (``jobs_job_retrying``,
    one range per type). The locking step checks the whole condition again on the row it locks.
    """
    scope_sql, scope_params = (scope or AllTenants()).sql("j")
    limits = dict(max_attempts or {})
    sql = f"""
        WITH caps AS (
            SELECT * FROM unnest(%(cap_names)s::text[], %(cap_values)s::int[]) AS c(name, cap)
        ),
        candidates AS (
            (SELECT j.id FROM jobs_job j
             WHERE j.state = 'running' AND j.lease_expires_at < {_NOW}
               AND j.attempts >= j.max_attempts AND {scope_sql}
             LIMIT %(limit)s)
            UNION ALL
            (SELECT j.id FROM jobs_job j
             WHERE j.state = 'queued' AND j.attempts >= j.max_attempts AND {scope_sql}
             LIMIT %(limit)s)
            UNION ALL
            (SELECT lowered.id FROM caps CROSS JOIN LATERAL (
                SELECT j.id FROM jobs_job j
                WHERE j.state = 'queued' AND j.attempts > 0
                  AND j.name = caps.name AND j.attempts >= caps.cap AND {scope_sql}
                LIMIT %(limit)s
             ) lowered
             LIMIT %(limit)s)
        ),
        exhausted AS (
            SELECT j.id FROM jobs_job j
            WHERE j.id IN (SELECT id FROM candidates)
              AND ((j.state = 'running' AND j.lease_expires_at < {_NOW}
                    AND j.attempts >= j.max_attempts)
                   OR (j.state = 'queued' AND j.attempts >= LEAST(
                         j.max_attempts,
                         COALESCE((SELECT cap FROM caps WHERE caps.name = j.name),
                                  j.max_attempts))))
            LIMIT %(limit)s
            FOR UPDATE OF j SKIP LOCKED
        )
        UPDATE jobs_job j
        SET last_error = CASE WHEN j.state = 'running' THEN %(expired)s ELSE %(exhausted)s END,
            error_detail = CASE WHEN j.state = 'running'
                THEN 'lease expired on the last attempt while held by ' || j.claimed_by
                ELSE 'no attempts left (' || j.attempts || ' used)' END,
            state = 'failed', finished_at = {_NOW},
            claim_token = NULL, lease_expires_at = NULL, claimed_by = ''
        FROM exhausted WHERE j.id = exhausted.id
        RETURNING j.id, j.job_id, j.name, j.tenant, j.state, j.last_error
        """
    params = {
        "cap_names": list(limits),
        "cap_values": list(limits.values()),
        "limit": limit,
        "now": now,
        "expired": ErrorCode.LEASE_EXPIRED,
        "exhausted": ErrorCode.ATTEMPTS_EXHAUSTED,
        **scope_params,
    }
    return sql, params


def prune(
    *,
    retention: Mapping[str, timedelta] | None = None,
    batch_size: int | None = None,
    max_batches: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, int]:
    """Delete terminal rows older than their retention, in bounded batches; counts by state.

    Call it outside a transaction so each batch commits on its own and holds locks briefly.
    """
    retention = retention or {
        RunState.SUCCEEDED: jobs_settings.SUCCEEDED_RETENTION,
        RunState.FAILED: jobs_settings.FAILED_RETENTION,
        RunState.CANCELLED: jobs_settings.CANCELLED_RETENTION,
    }
    batch_size = batch_size or jobs_settings.PRUNE_BATCH_SIZE
    deleted: dict[str, int] = {}
    with _db.cursor(using) as cur:
        for state, age in retention.items():
            deleted[state] = 0
            for _batch in range(max_batches):
                cur.execute(
                    f"""
                    DELETE FROM jobs_job WHERE id IN (
                        SELECT id FROM jobs_job
                        WHERE state = %(state)s
                          AND finished_at < {_NOW} - make_interval(secs => %(age)s)
                        ORDER BY finished_at
                        LIMIT %(batch)s
                        FOR UPDATE SKIP LOCKED
                    )
                    """,
                    {"state": state, "age": _db.seconds(age), "batch": batch_size, "now": now},
                )
                deleted[state] += cur.rowcount
                if cur.rowcount < batch_size:
                    break
    return deleted


def backlog(
    *,
    scope: Scope | None = None,
    supported: Collection[str] = (),
    using: str = DEFAULT_DB_ALIAS,
) -> list[BacklogRow]:
    """Queued jobs per name and tenant within a scope, marked supported or not."""
    scope_sql, scope_params = (scope or AllTenants()).sql("j")
    with _db.cursor(using) as cur:
        cur.execute(
            f"""
            SELECT j.name, j.tenant, count(*),
                   count(*) FILTER (WHERE j.run_after <= statement_timestamp())
            FROM jobs_job j
            WHERE j.state = 'queued' AND {scope_sql}
            GROUP BY j.name, j.tenant
            ORDER BY j.name, j.tenant
            """,
            scope_params,
        )
        rows = cur.fetchall()
    names = set(supported)
    return [
        BacklogRow(name, tenant, name in names, queued, due) for name, tenant, queued, due in rows
    ]


def pending(
    *,
    scope: Scope | None = None,
    names: Collection[str] = (),
    due_within: timedelta = timedelta(0),
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, int]:
    """Unfinished work of these names: running jobs, and queued jobs due within the horizon."""
    scope_sql, scope_params = (scope or AllTenants()).sql("j")
    with _db.cursor(using) as cur:
        cur.execute(
            f"""
            SELECT j.name, count(*) FROM jobs_job j
            WHERE j.name = ANY(%(names)s) AND {scope_sql}
              AND (j.state = 'running'
                   OR (j.state = 'queued' AND j.attempts < j.max_attempts
                       AND j.run_after <= statement_timestamp()
                                          + make_interval(secs => %(horizon)s)))
            GROUP BY j.name
            """,
            {"names": list(names), "horizon": _db.seconds(due_within), **scope_params},
        )
        return dict(cur.fetchall())


def _sweep(sql: str, params: dict[str, Any], using: str) -> list[SweepRow]:
    with _db.cursor(using) as cur:
        cur.execute(sql, params)
        return [SweepRow(*row) for row in cur.fetchall()]
