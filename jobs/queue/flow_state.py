"""Flow control as the console and the gauges see it: running jobs, bucket tokens, due jobs.

Reads only, for :mod:`jobs.admin.flow` and :mod:`jobs.scheduler.gauges`; the claim never
counts a backlog (:mod:`jobs.queue.flow`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS

from jobs.queue import _db
from jobs.queue.flow import _SINCE, FlowLimits

#: The console's and the gauges' counts of due jobs read at most this many rows per type:
#: beyond it a count is a floor (the claim itself never counts a backlog).
COUNT_CAP = 10_000


@dataclass(frozen=True, slots=True)
class FlowState:
    """A type's flow right now: running jobs, bucket tokens, due jobs (for the console)."""

    name: str
    running: int
    due: int
    tokens: float | None
    refilled_at: datetime | None


def state(
    limits: Mapping[str, FlowLimits], *, using: str = DEFAULT_DB_ALIAS
) -> dict[str, FlowState]:
    """Each type's running and due jobs and its bucket's tokens now (refilled to now)."""
    if not limits:
        return {}
    names = sorted(limits)
    rates = [limits[name].rate for name in names]
    bursts = [limits[name].burst for name in names]
    with _db.bound_cursor(using) as cur:
        cur.execute(
            f"""
            SELECT w.name,
                (SELECT count(*) FROM jobs_job r
                 WHERE r.state = 'running' AND r.name = w.name)::int,
                (SELECT count(*) FROM (
                    SELECT 1 FROM jobs_job q
                    WHERE q.state = 'queued' AND q.name = w.name
                      AND q.run_after <= statement_timestamp()
                    LIMIT %(cap)s) due)::int,
                LEAST(w.burst, f.tokens + w.rate * {_SINCE.format("f.refilled_at")}),
                f.refilled_at
            FROM unnest(%(names)b::text[], %(rates)b::float8[], %(bursts)b::float8[])
                AS w(name, rate, burst)
            LEFT JOIN jobs_flow f ON f.name = w.name
            """,
            {"names": names, "rates": rates, "bursts": bursts, "cap": COUNT_CAP},
        )
        rows = cur.fetchall()
    return {
        name: FlowState(
            name, running, due, None if limits[name].rate is None else tokens, refilled_at
        )
        for name, running, due, tokens, refilled_at in rows
    }


@dataclass(frozen=True, slots=True)
class TenantFlow:
    """One tenant of a tenant-ordered type: its due and running jobs and its weight."""

    tenant: str
    due: int
    running: int
    weight: int


def tenant_backlog(
    name: str, *, limit: int = 20, using: str = DEFAULT_DB_ALIAS
) -> list[TenantFlow]:
    """The tenants of a tenant-ordered type with the most due jobs, with their running jobs
    and weights. Due jobs are counted among the first :data:`COUNT_CAP` in claim order, so
    the read stays bounded on a deep backlog (a tenant's count is then a floor)."""
    with _db.bound_cursor(using) as cur:
        cur.execute(
            """
            WITH due AS (
                SELECT d.tenant, count(*)::int AS n FROM (
                    SELECT j.tenant FROM jobs_job j
                    WHERE j.state = 'queued' AND j.name = %(name)s
                      AND j.run_after <= statement_timestamp()
                    ORDER BY j.priority DESC, j.run_after, j.id
                    LIMIT %(cap)s
                ) d
                GROUP BY d.tenant
            ),
            running AS (
                SELECT r.tenant, count(*)::int AS n FROM jobs_job r
                WHERE r.state = 'running' AND r.name = %(name)s
                GROUP BY r.tenant
            )
            SELECT t.tenant, COALESCE(d.n, 0), COALESCE(r.n, 0), COALESCE(tw.weight, 1)
            FROM (SELECT tenant FROM due UNION SELECT tenant FROM running) t
            LEFT JOIN due d USING (tenant)
            LEFT JOIN running r USING (tenant)
            LEFT JOIN jobs_tenantweight tw ON tw.tenant = t.tenant
            ORDER BY COALESCE(d.n, 0) DESC, COALESCE(r.n, 0) DESC, t.tenant
            LIMIT %(limit)s
            """,
            {"name": name, "limit": limit, "cap": COUNT_CAP},
        )
        return [TenantFlow(*row) for row in cur.fetchall()]


def tenant_tokens(
    name: str, tenants: Iterable[str], limits: FlowLimits, *, using: str = DEFAULT_DB_ALIAS
) -> dict[str, float]:
    """The tokens in these tenants' buckets of a type with a tenant rate limit, refilled to
    now, as the claim reads them (a tenant without a bucket row has a full one); one query."""
    tenants = sorted(set(tenants))
    if limits.tenant_rate is None or not tenants:
        return {}
    with _db.bound_cursor(using) as cur:
        cur.execute(
            f"""
            SELECT t.tenant, COALESCE(
                LEAST(%(burst)s, tb.tokens + %(rate)s * {_SINCE.format("tb.refilled_at")}),
                %(burst)s)
            FROM unnest(%(tenants)b::text[]) AS t(tenant)
            LEFT JOIN jobs_flowtenant tb ON tb.name = %(name)s AND tb.tenant = t.tenant
            """,
            {
                "name": name,
                "tenants": tenants,
                "rate": limits.tenant_rate,
                "burst": limits.tenant_burst,
            },
        )
        return {tenant: float(tokens) for tenant, tokens in cur.fetchall()}
