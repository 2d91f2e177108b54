"""Maintenance passes over the jobs table: expired leases, exhaustion, retention; its gauges.

Each pass is one bounded, set-based statement that skips rows another pass has locked, so any
number of workers and the scheduler can run them at once. ``now`` defaults to PostgreSQL's
clock; tests pass it to put rows on either side of a cutoff.

Expired leases (a worker died or stalled)::

    running, lease expired, attempts left ──requeue_expired──▶ queued (due now)
    running, lease expired, last attempt  ──fail_exhausted───▶ failed / lease_expired
    queued, attempts ≥ limit (lowered)    ──fail_exhausted───▶ failed / attempts_exhausted

The scheduler's leader reads the gauges: :func:`backlog` (bounded counts per name) and
:func:`table_health` (catalog reads only).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.backends.utils import CursorWrapper

from jobs.core.conf import jobs_settings
from jobs.queue import _db, attempts, flow, history, rollup
from jobs.queue import bound as binding
from jobs.queue.types import (
    BACKLOG_CAP,
    AllTenants,
    BacklogRow,
    Scope,
    SweepRow,
    TableHealth,
)
from jobs.runs import TERMINAL_STATES, ErrorCode, RunState

_FAIR = flow.FAIR_AT_ENQUEUE.format(name="j.name")

_NOW = "COALESCE(%(now)s::timestamptz, statement_timestamp())"
# A swept attempt's queue latency, from the row before the sweep (its run time is unknown:
# its worker never reported, so the rollup counts the attempt with no run time).
_WAITED = "GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8"
_SWEPT_COLUMNS = "id, job_id, name, tenant, state, last_error"
_SWEPT = ", ".join(f"j.{column.strip()}" for column in _SWEPT_COLUMNS.split(","))
# Swept jobs in the console's history: a requeued attempt is a retry, the rest ended.
_ROLLED_READ = rollup.reads()
_ROLLED = rollup.cte(
    "SELECT name, CASE state WHEN 'queued' THEN 'retried' ELSE state END, last_error, "
    "NULL::float8, waited FROM swept"
)
# The attempt a dead or stalled worker never reported on, as its log entry (requeued jobs).
_EXPIRED_ENTRY = attempts.entry_sql(
    row="j",
    outcome="'lease_expired'",
    code=f"'{ErrorCode.LEASE_EXPIRED}'",
    error="'lease expired while held by ' || j.claimed_by",
)


def _settling(swept: str, ends: str) -> str:
    """The batch rows the jobs in ``swept`` that it ends (``ends``, of ``s``) move, locked
    without waiting: a job whose batch another session holds is left for the next pass.
    Waiting here, after the job rows, could deadlock with an add to the batch, which locks
    the batch row first and the jobs its members wait for as it commits. (COALESCE: see
    jobs.queue.batches.lock_for.)"""
    return f"""settling AS MATERIALIZED (
            SELECT b.id FROM jobs_batch b
            WHERE b.id IN (SELECT COALESCE(j.batch_id, 0)
                           FROM jobs_job j JOIN {swept} s ON j.id = s.id WHERE {ends})
            FOR NO KEY UPDATE OF b SKIP LOCKED
        )"""


_SETTLES = "(j.batch_id IS NULL OR j.batch_id IN (SELECT id FROM settling))"


def requeue_expired(
    *,
    scope: Scope | None = None,
    limit: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[SweepRow]:
    """Return running jobs whose lease expired, with attempts left, to the queue (due now).

    Their old claim token is cleared, so the stalled worker's late outcome is fenced out. A
    job an operator asked to stop (:func:`jobs.queue.cancel_running`) ends ``cancelled``
    instead. A requeued job's attempt is logged as ``lease_expired``.
    """
    scope_sql, scope_params = (scope or AllTenants()).sql("j")
    return _sweep(
        f"""
        WITH expired AS (
            SELECT j.id, j.cancel_requested_at IS NOT NULL AS asked, {_WAITED} AS waited
            FROM jobs_job j
            WHERE j.state = 'running' AND j.lease_expires_at < {_NOW}
              AND j.attempts < j.max_attempts AND {scope_sql}
            ORDER BY j.lease_expires_at
            LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        ),
        {_settling("expired", "s.asked")},
        swept AS (
        UPDATE jobs_job j
        SET state = CASE WHEN asked THEN 'cancelled' ELSE 'queued' END,
            run_after = CASE WHEN asked THEN j.run_after ELSE {_NOW} END,
            finished_at = CASE WHEN asked THEN {_NOW} END,
            key_held = j.keyed,
            last_error = CASE WHEN asked THEN %(cancelled)s ELSE %(code)s END,
            error_detail = CASE WHEN asked
                THEN 'cancelled by ' || j.cancel_requested_by
                     || '; the lease expired while held by ' || j.claimed_by
                ELSE 'lease expired while held by ' || j.claimed_by END,
            attempt_log = CASE WHEN asked THEN j.attempt_log
                               ELSE j.attempt_log || {_EXPIRED_ENTRY} END,
            claim_token = NULL, lease_expires_at = NULL,
            claimed_by = CASE WHEN asked THEN j.claimed_by ELSE '' END,
            -- Back in the queue in its type's order now (jobs.queue.flow).
            fair = CASE WHEN asked THEN j.fair ELSE {_FAIR} END
        FROM expired WHERE j.id = expired.id
          AND (NOT expired.asked OR {_SETTLES})
        RETURNING {_SWEPT}, expired.waited
        ),
        {_ROLLED}
        SELECT {_SWEPT_COLUMNS} FROM swept WHERE {_ROLLED_READ}
        """,
        {
            "limit": limit,
            "now": now,
            "code": ErrorCode.LEASE_EXPIRED,
            "cancelled": ErrorCode.CANCELLED,
            **scope_params,
        },
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

    A running job whose lease expired on its last attempt fails as ``lease_expired`` (or
    ends ``cancelled`` if an operator had asked it to stop); a queued job at or over its
    limit (lowered since it was enqueued: pass the types' current limits as
    ``max_attempts``) fails as ``attempts_exhausted``.
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
            -- PostgreSQL guesses a third of the rows for attempts >= max_attempts; in the
            -- index's own order its partial index is the cheapest plan, however wrong the guess.
            (SELECT j.id FROM jobs_job j
             WHERE j.state = 'queued' AND j.attempts >= j.max_attempts AND {scope_sql}
             ORDER BY j.id
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
            SELECT j.id, j.state = 'running' AND j.cancel_requested_at IS NOT NULL AS asked,
                   CASE WHEN j.state = 'running' THEN {_WAITED} END AS waited
            FROM jobs_job j
            WHERE j.id IN (SELECT id FROM candidates)
              AND ((j.state = 'running' AND j.lease_expires_at < {_NOW}
                    AND j.attempts >= j.max_attempts)
                   OR (j.state = 'queued' AND j.attempts >= LEAST(
                         j.max_attempts,
                         COALESCE((SELECT cap FROM caps WHERE caps.name = j.name),
                                  j.max_attempts))))
            LIMIT %(limit)s
            FOR UPDATE OF j SKIP LOCKED
        ),
        {_settling("exhausted", "TRUE")},
        swept AS (
        UPDATE jobs_job j
        SET last_error = CASE WHEN asked THEN %(cancelled)s
                              WHEN j.state = 'running' THEN %(expired)s ELSE %(exhausted)s END,
            error_detail = CASE
                WHEN asked THEN 'cancelled by ' || j.cancel_requested_by
                     || '; the lease expired while held by ' || j.claimed_by
                WHEN j.state = 'running'
                THEN 'lease expired on the last attempt while held by ' || j.claimed_by
                ELSE 'no attempts left (' || j.attempts || ' used)' END,
            -- An operator asked the dead worker's job to stop: it ends as asked.
            state = CASE WHEN asked THEN 'cancelled' ELSE 'failed' END,
            finished_at = {_NOW}, key_held = j.keyed,
            claim_token = NULL, lease_expires_at = NULL,
            -- The last attempt's worker stays with it (jobs.queue.attempts).
            claimed_by = CASE WHEN j.state = 'running' THEN j.claimed_by ELSE '' END
        FROM exhausted WHERE j.id = exhausted.id AND {_SETTLES}
        RETURNING {_SWEPT}, exhausted.waited
        ),
        {_ROLLED}
        SELECT {_SWEPT_COLUMNS} FROM swept WHERE {_ROLLED_READ}
        """
    params = {
        "cap_names": list(limits),
        "cap_values": list(limits.values()),
        "limit": limit,
        "now": now,
        "expired": ErrorCode.LEASE_EXPIRED,
        "exhausted": ErrorCode.ATTEMPTS_EXHAUSTED,
        "cancelled": ErrorCode.CANCELLED,
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
    retention = retention or {state: history.retention(state) for state in TERMINAL_STATES}
    batch_size = batch_size or jobs_settings.PRUNE_BATCH_SIZE
    deleted: dict[str, int] = {}
    with _db.cursor(using) as cur:
        for state, age in retention.items():
            deleted[state] = 0
            # One ordered range of jobs_job_terminal (state, key_held, finished_at) at a time.
            for held in (False, True):
                params = {
                    "state": state,
                    "held": held,
                    "age": _db.seconds(age),
                    "batch": batch_size,
                    "now": now,
                }
                for _batch in range(max_batches):
                    cur.execute(
                        f"""
                        WITH gone AS (
                            DELETE FROM jobs_job WHERE id = ANY(ARRAY(
                                SELECT id FROM jobs_job
                                WHERE state = %(state)s AND key_held = %(held)s
                                  AND finished_at < {_NOW} - make_interval(secs => %(age)s)
                                ORDER BY finished_at
                                LIMIT %(batch)s
                                FOR UPDATE SKIP LOCKED
                            ))
                            RETURNING id
                        ),
                        unlinked AS (
                            DELETE FROM jobs_dependency d WHERE d.job IN (SELECT id FROM gone)
                        )
                        SELECT count(*) FROM gone
                        """,
                        params,
                    )
                    [count] = cur.fetchone()
                    deleted[state] += count
                    if count < batch_size:
                        break
    return deleted


#: The queued (name, priority) levels, by skipping through ``jobs_job_claim`` (leading columns
#: ``name, priority DESC``): one index descent per level, however many rows each level holds.
#: Each step takes the next lower priority of the same name, else the next name's highest.
#: The counts below order by the index's own columns: with ORDER BY … LIMIT the index is the
#: only plan that can stop early, where a bare LIMIT invites a sequential scan that the planner
#: expects to stop early too (it assumes a name's rows are spread evenly through the table).
_LEVELS = """
    levels AS (
        (SELECT j.name, j.priority FROM jobs_job j WHERE j.state = 'queued'
         ORDER BY j.name, j.priority DESC LIMIT 1)
        UNION ALL
        SELECT nxt.name, nxt.priority FROM levels l CROSS JOIN LATERAL (
            (SELECT j.name, j.priority FROM jobs_job j
             WHERE j.state = 'queued' AND j.name = l.name AND j.priority < l.priority
             ORDER BY j.priority DESC LIMIT 1)
            UNION ALL
            (SELECT j.name, j.priority FROM jobs_job j
             WHERE j.state = 'queued' AND j.name > l.name
             ORDER BY j.name, j.priority DESC LIMIT 1)
            LIMIT 1
        ) nxt
    )"""

_BACKLOG = f"""
    WITH RECURSIVE {_LEVELS}
    SELECT n.name,
        (SELECT count(*) FROM (
            SELECT 1 FROM jobs_job j WHERE j.state = 'queued' AND j.name = n.name
            ORDER BY j.priority DESC, j.run_after, j.id
            LIMIT %(over)s) q),
        (SELECT count(*) FROM (
            SELECT 1 FROM levels l CROSS JOIN LATERAL (
                SELECT 1 FROM jobs_job j
                WHERE j.state = 'queued' AND j.name = l.name AND j.priority = l.priority
                  AND j.run_after <= statement_timestamp()
                ORDER BY j.run_after, j.id
                LIMIT %(over)s) due
            WHERE l.name = n.name
            LIMIT %(over)s) d),
        (SELECT min(first.run_after) FILTER (WHERE first.run_after <= statement_timestamp())
         FROM levels l CROSS JOIN LATERAL (
            SELECT j.run_after FROM jobs_job j
            WHERE j.state = 'queued' AND j.name = l.name AND j.priority = l.priority
            ORDER BY j.run_after LIMIT 1) first
         WHERE l.name = n.name)
    FROM (SELECT DISTINCT l.name FROM levels l) n
    ORDER BY n.name
"""

_ESTIMATE = (
    "EXPLAIN (FORMAT JSON) SELECT 1 FROM jobs_job j WHERE j.state = 'queued' AND j.name = %s"
)


def backlog(
    *,
    supported: Collection[str] = (),
    cap: int = BACKLOG_CAP,
    using: str = DEFAULT_DB_ALIAS,
) -> list[BacklogRow]:
    """Queued jobs per name over every tenant, marked supported or not; cost bounded by ``cap``.

    Counting every queued row costs as much as the backlog is long (half a second at a million
    rows), so each count stops at ``cap + 1``: up to the cap it is exact, past it ``queued`` is
    the planner's row estimate (see :class:`BacklogRow`). The statement reads at most about
    ``2 * (cap + 1)`` live claim-index entries per name, plus one per (name, priority) level,
    plus the dead entries vacuum has not removed yet (as claims do; docs/queue.md, "Table
    health"). Tenants are not told apart: the claim index does not hold them, so a per-tenant count
    would read every row of a name again.
    """
    sql, params = backlog_sql(cap=cap)
    with _db.cursor(using) as cur:
        cur.execute(sql, params)
        counted = cur.fetchall()
        names = set(supported)
        return [
            BacklogRow(
                name=name,
                supported=name in names,
                queued=queued if queued <= cap else max(cap + 1, _estimate(cur, name)),
                queued_exact=queued <= cap,
                due=due,
                due_exact=due <= cap,
                oldest_due=oldest_due,
            )
            for name, queued, due, oldest_due in counted
        ]


def backlog_sql(*, cap: int = BACKLOG_CAP) -> tuple[str, dict[str, Any]]:
    """The backlog statement and its parameters (also used for EXPLAIN)."""
    if cap < 1:
        raise ValueError(f"the backlog cap must be at least 1, got {cap}")
    return _BACKLOG, {"over": cap + 1}


def _estimate(cur: CursorWrapper, name: str) -> int:
    """The planner's row estimate for the queued jobs of one name (no row is read).

    As fresh as the table's last ANALYZE, scaled by its current size; the migrations'
    ``(state, name)`` MCV statistics keep it close where states and names are correlated.
    """
    cur.execute(_ESTIMATE, [name])
    [plan] = _db.load_json(cur.fetchone()[0])
    return int(plan["Plan"]["Plan Rows"])


_HEALTH = """
SELECT c.relname, COALESCE(s.n_live_tup, 0), COALESCE(s.n_dead_tup, 0), pg_table_size(c.oid),
       (SELECT COALESCE(json_object_agg(i.relname, pg_relation_size(i.oid)), '{}')
        FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
        WHERE x.indrelid = c.oid),
       s.last_autovacuum, s.last_autoanalyze
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = %(table)s::regclass
"""


def table_health(table: str = "jobs_job", *, using: str = DEFAULT_DB_ALIAS) -> TableHealth:
    """Dead and live tuples, sizes and last autovacuum of a table: what an operator watches.

    Reads only catalogs and the statistics system (sizes come from the files' lengths), so
    it costs the same whatever the table holds. Dead tuples that keep climbing mean vacuum
    does not keep up (or a long transaction holds it back); index sizes that grow while the
    backlog does not mean bloat.
    """
    with _db.cursor(using) as cur:
        cur.execute(_HEALTH, {"table": table})
        name, live, dead, table_bytes, indexes, vacuumed, analyzed = cur.fetchone()
    return TableHealth(
        table=name,
        live_tuples=live,
        dead_tuples=dead,
        table_bytes=table_bytes,
        index_bytes=dict(sorted(_db.load_json(indexes).items())),
        last_autovacuum=vacuumed,
        last_autoanalyze=analyzed,
    )


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
        rows = [SweepRow(*row) for row in cur.fetchall()]
        stopped = [row.id for row in rows if row.state == RunState.CANCELLED]
        if stopped:  # rare: jobs an operator asked to stop, whose worker died
            cur.execute(
                "SELECT id, cancel_requested_by FROM jobs_job WHERE id = ANY(%s)", [stopped]
            )
            by_whom: dict[str, list[int]] = {}
            for id_, by in cur.fetchall():
                by_whom.setdefault(by, []).append(id_)
            for by, ids in by_whom.items():
                binding.cancelled(ids, by=by, using=using)
    return rows
