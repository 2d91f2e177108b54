"""Flow control held by the claim: global and tenant concurrency, rate limits, tenant fairness.

Every limit is read and enforced inside the claim statement, so it holds across any number of
workers on any number of hosts with nothing kept in a worker's memory.

**The gate.** A job type with a limit the fleet shares has a row in ``jobs_flow``. A claim of
the type locks the row (``SKIP LOCKED``: a claim that finds it locked takes none of the type
this time) and, when it starts jobs, bumps the row's ``version`` in the same statement. The
lock is taken only on the version the claim's snapshot saw; a row changed since then is
skipped too. So a claim that passes the gate sees every start of the type that committed
before it, and none is in progress: the running jobs it counts and the buckets it reads are
exact, and two claims cannot both take the last free place. Ends of jobs need no write here:
a job that stops running (an outcome, a lease sweep, a cancel) frees its place by not being
``running`` any more, so no count can drift. A claim that reads a job as running that has
just ended is only cautious: the next claim sees it.

**Rate limits** are token buckets refilled continuously (``Rate``): one per type in the gate
row, one per (type, tenant) in ``jobs_flowtenant``, written by the gated claims only.

**Tenant order.** For a type that is fair or has tenant limits, the claim reads tenant by
tenant: the tenants with queued jobs of the type (one hop each along the per-tenant claim
index, downwards from the tenant the worker's previous claim ended at, so every tenant comes
round; downwards, because a hop then lands at the end of a tenant's range, past the entries
its claimed jobs left at the start), each one's free room (tenant limit, tenant bucket) and,
when several are read, due jobs (up to the claim's limit), and gives each tenant a share of
the claim weighted by ``jobs_tenantweight``, handing what a tenant cannot use to the others.
Enqueue puts such types' rows in the per-tenant index
(the ``fair`` column), as the gate rows say (:func:`ensure`).

**Accounts.** A fair type without tenant limits keeps the weights over time rather than within
each claim: each tenant has an account (``jobs_fairaccount``) of its starts, each counted as
1/weight; the claim serves the least served first, and its statement adds its starts to the
accounts (:data:`jobs.queue.flow_fair.FAIR_ROWS`).

This module holds the flow controls a worker plans with and the claim's form; the claim's SQL
fragments are in :mod:`jobs.queue.flow_claim` (requests, gate, tenant order, after the claim)
and :mod:`jobs.queue.flow_fair` (accounts, priority classes), and the console's reads in
:mod:`jobs.queue.flow_state`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, transaction

from jobs.queue import _db
from jobs.queue._arrays import Array, array
from jobs.queue.types import ClaimRequest

# Seconds since a bucket was last refilled, as a float (EXTRACT gives numeric).
_SINCE = "EXTRACT(EPOCH FROM statement_timestamp() - {})::float8"


@dataclass(frozen=True, slots=True)
class FlowLimits:
    """A job type's flow controls, as the claim applies them (rates in starts a second)."""

    global_concurrency: int | None = None
    tenant_concurrency: int | None = None
    rate: float | None = None
    burst: float | None = None
    tenant_rate: float | None = None
    tenant_burst: float | None = None
    fair: bool = False
    lower_share: float | None = None  # of each claim, kept for jobs below the top class

    @property
    def gated(self) -> bool:
        """Claims take the type's gate: some limit is shared by every worker."""
        return (
            self.global_concurrency is not None
            or self.tenant_concurrency is not None
            or self.rate is not None
            or self.tenant_rate is not None
        )

    @property
    def tenant_ordered(self) -> bool:
        """Claims read the type tenant by tenant."""
        return self.fair or self.tenant_concurrency is not None or self.tenant_rate is not None

    @property
    def tiered(self) -> bool:
        """Fair with no tenant limit: fair within the highest class with due jobs."""
        return self.fair and self.tenant_concurrency is None and self.tenant_rate is None


def limits_of(policy: object) -> FlowLimits | None:
    """A policy's flow controls (:class:`jobs.Policy`), or None when it has none."""
    rate = getattr(policy, "rate_limit", None)
    tenant_rate = getattr(policy, "tenant_rate_limit", None)
    limits = FlowLimits(
        global_concurrency=getattr(policy, "global_concurrency", None),
        tenant_concurrency=getattr(policy, "tenant_concurrency", None),
        rate=None if rate is None else rate.per_second,
        burst=None if rate is None else float(rate.capacity),
        tenant_rate=None if tenant_rate is None else tenant_rate.per_second,
        tenant_burst=None if tenant_rate is None else float(tenant_rate.capacity),
        fair=bool(getattr(policy, "fair", False)),
        lower_share=getattr(policy, "lower_priority_share", None),
    )
    controlled = limits.gated or limits.tenant_ordered or limits.lower_share is not None
    return limits if controlled else None


def ensure(
    limits: Mapping[str, FlowLimits], *, repair: bool = True, using: str = DEFAULT_DB_ALIAS
) -> None:
    """Give each type with flow controls its gate row, saying whether it is tenant-ordered.

    Workers call this at start from their registry (a gate row deleted later is put back
    by :func:`restore_gates`). When a type becomes tenant-ordered
    (or stops being so), its queued jobs are moved into (or out of) the per-tenant claim
    index. With ``repair``, queued jobs of a tenant-ordered type still outside the index
    (enqueued in a transaction that committed across the change) are moved in too: that
    reads the type's queued jobs once.
    """
    if not limits:
        return
    names = sorted(limits)
    ordered = [limits[name].tenant_ordered for name in names]
    with transaction.atomic(using=using), _db.bound_cursor(using) as cur:
        cur.execute(
            """
            WITH wanted AS (
                SELECT * FROM unnest(%(names)b::text[], %(ordered)b::bool[]) AS w(name, ordered)
            ),
            before AS (
                SELECT f.name, f.tenant_ordered FROM jobs_flow f JOIN wanted w USING (name)
            ),
            upserted AS (
                INSERT INTO jobs_flow (name, version, tenant_ordered)
                SELECT name, 0, ordered FROM wanted ORDER BY name
                ON CONFLICT (name) DO UPDATE
                SET tenant_ordered = EXCLUDED.tenant_ordered, updated_at = statement_timestamp()
                WHERE jobs_flow.tenant_ordered IS DISTINCT FROM EXCLUDED.tenant_ordered
                RETURNING name, tenant_ordered
            )
            SELECT u.name, u.tenant_ordered FROM upserted u
            LEFT JOIN before b USING (name)
            WHERE u.tenant_ordered IS DISTINCT FROM COALESCE(b.tenant_ordered, FALSE)
            """,
            {"names": names, "ordered": ordered},
        )
        changed = dict(cur.fetchall())
        if repair:
            changed.update(
                {
                    name: True
                    for name in names
                    if limits[name].tenant_ordered and name not in changed
                }
            )
        for name, tenant_ordered in changed.items():
            cur.execute(
                "UPDATE jobs_job SET fair = %s WHERE state = 'queued' AND name = %s "
                "AND fair IS DISTINCT FROM %s",
                [tenant_ordered, name, tenant_ordered],
            )


def restore_gates(limits: Mapping[str, FlowLimits], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Put back the gate rows of these types that are missing (a row deleted by hand), and
    the queued jobs enqueued meanwhile in tenant order; never touches a row that exists."""
    names = sorted(limits)
    with transaction.atomic(using=using), _db.bound_cursor(using) as cur:
        cur.execute(
            "INSERT INTO jobs_flow (name, version, tenant_ordered) "
            "SELECT name, 0, ordered "
            "FROM unnest(%(names)b::text[], %(ordered)b::bool[]) AS w(name, ordered) "
            "ON CONFLICT (name) DO NOTHING RETURNING name, tenant_ordered",
            {"names": names, "ordered": [limits[name].tenant_ordered for name in names]},
        )
        for name, tenant_ordered in cur.fetchall():
            if tenant_ordered:
                cur.execute(
                    "UPDATE jobs_job SET fair = TRUE "
                    "WHERE state = 'queued' AND name = %s AND NOT fair",
                    [name],
                )


#: The names of the types read tenant by tenant, as one array: one scan of the (small) gate
#: table. Enqueue's COPY reads it once a batch.
TENANT_ORDERED_NAMES = (
    "(SELECT COALESCE(array_agg(f.name::text), '{}') FROM jobs_flow f WHERE f.tenant_ordered)"
)
#: Enqueue's value for the ``fair`` column of a row named ``{name}``: whether its type is
#: read tenant by tenant. One scan of the (small) gate table per statement.
FAIR_AT_ENQUEUE = (
    "({name} = ANY(" + TENANT_ORDERED_NAMES.replace("{", "{{").replace("}", "}}") + "::text[]))"
)
#: The same for a job enqueued on its own, named ``{name}``: a look-up of its type's gate row
#: by key, which cost the server 8 µs a job less than collecting every tenant-ordered name.
FAIR_OF_ONE = "EXISTS (SELECT FROM jobs_flow f WHERE f.name = {name} AND f.tenant_ordered)"


def request_params(
    requests: list[ClaimRequest],
    limits: Mapping[str, FlowLimits],
    after: Mapping[str, str],
) -> dict[str, Array | list[Any]]:
    """The claim's per-request flow parameters, aligned with its names."""
    none = FlowLimits()
    rows = [limits.get(r.name, none) for r in requests]
    return {
        "gcaps": array("integer", [f.global_concurrency for f in rows]),
        "tcaps": array("integer", [f.tenant_concurrency for f in rows]),
        "rates": array("float8", [f.rate for f in rows]),
        "bursts": array("float8", [f.burst for f in rows]),
        "trates": array("float8", [f.tenant_rate for f in rows]),
        "tbursts": array("float8", [f.tenant_burst for f in rows]),
        "gated": array("boolean", [f.gated for f in rows]),
        "ordered": array("boolean", [f.tenant_ordered for f in rows]),
        "afters": array("text", [after.get(r.name, "") for r in requests]),
        "lshares": array("float8", [f.lower_share for f in rows]),
    }


@dataclass(frozen=True, slots=True)
class FlowForm:
    """Which parts of the flow claim a set of requests needs (the rest is not planned)."""

    gated: bool  # some name takes its gate
    plain: bool  # some name is claimed in the plain order
    tiered: bool  # some name is fair with no tenant limit (fair within its top class)
    capped: bool  # some name is tenant-ordered with a tenant limit
    tenant_rated: bool  # some name has a tenant rate limit
    reserved: bool  # some name claimed in the plain order keeps a share for lower classes
    # The statement also writes outcomes (``written``, jobs.queue.cycle): the jobs it ends
    # are running in its snapshot, and their places are free once it commits.
    releasing: bool = False


def merged(requests: Iterable[ClaimRequest]) -> list[ClaimRequest]:
    """One request per name, in first-seen order (limits summed, the lowest attempt cap):
    two requests for one limited name would each get the whole of its room."""
    by_name: dict[str, ClaimRequest] = {}
    for r in requests:
        seen = by_name.get(r.name)
        if seen is None:
            by_name[r.name] = r
            continue
        caps = [c for c in (seen.max_attempts, r.max_attempts) if c is not None]
        by_name[r.name] = ClaimRequest(r.name, seen.limit + r.limit, min(caps) if caps else None)
    return list(by_name.values())


def form(
    requests: Iterable[ClaimRequest], limits: Mapping[str, FlowLimits] | None
) -> FlowForm | None:
    """The flow claim's form for these requests; None when no name has flow controls."""
    if not limits:
        return None
    asked = [limits.get(r.name) for r in requests]
    if not any(asked):
        return None
    return FlowForm(
        gated=any(f is not None and f.gated for f in asked),
        plain=any(f is None or not f.tenant_ordered for f in asked),
        tiered=any(f is not None and f.tiered for f in asked),
        capped=any(f is not None and f.tenant_ordered and not f.tiered for f in asked),
        tenant_rated=any(f is not None and f.tenant_rate is not None for f in asked),
        reserved=any(
            f is not None and not f.tenant_ordered and f.lower_share is not None for f in asked
        ),
    )


def next_cursor(after: str, tenants: Iterable[str]) -> str:
    """Where a tenant-ordered name's next claim starts: past the last tenant this one reached.

    The claim reads the tenants below ``after`` first, highest first, then wraps round to
    the highest and down to ``after``, so the last one reached is the lowest claimed at or
    above ``after`` if it wrapped, else the lowest claimed.
    """
    tenants = set(tenants)
    if not tenants:
        return after
    wrapped = [t for t in tenants if t >= after]
    return min(wrapped) if wrapped else min(tenants)


def rate_retry_seconds(limits: FlowLimits | None, *, floor: float = 0.005) -> float:
    """How soon a worker tries a limited type again after a claim left it short.

    A freed place or a token elsewhere in the fleet sends no notice, so the worker looks
    again shortly: at the bucket's next token, between ``floor`` and 50 ms.
    """
    if limits is None:
        return 0.05
    rates = [r for r in (limits.rate, limits.tenant_rate) if r]
    if not rates:
        return 0.05
    return min(0.05, max(floor, 1.0 / max(rates)))
