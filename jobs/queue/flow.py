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
accounts (:data:`FAIR_ROWS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
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


#: What each name asks for, with its flow controls (see :func:`request_params`).
WANTED = """
wanted AS (
    SELECT * FROM unnest(
        %(names)b::text[], %(limits)b::int[], %(caps)b::int[], %(gcaps)b::int[],
        %(tcaps)b::int[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[],
        %(tbursts)b::float8[], %(gated)b::bool[], %(ordered)b::bool[], %(afters)b::text[],
        %(lshares)b::float8[]
    ) WITH ORDINALITY AS w(name, asked, cap, gcap, tcap, rate, burst, trate, tburst, gated,
                           ordered, after, lshare, ord)
    WHERE {paused_names}
)"""

# The gates of the gated names, locked only at the version this statement's snapshot saw,
# then each name's room: what it asks, within its global limit and its bucket.
GATE = f"""
seen AS MATERIALIZED (
    SELECT f.name, f.version FROM jobs_flow f
    WHERE f.name IN (SELECT w.name FROM wanted w WHERE w.gated)
),
gate AS MATERIALIZED (
    SELECT f.name, f.tokens, f.refilled_at
    FROM jobs_flow f JOIN seen s ON f.name = s.name AND f.version = s.version
    FOR UPDATE OF f SKIP LOCKED
),
room AS MATERIALIZED (
    SELECT w.name, w.cap, w.ord, w.tcap, w.trate, w.tburst, w.ordered, w.after, w.lshare,
        CASE WHEN NOT w.gated THEN w.asked
             WHEN g.name IS NULL THEN 0
             ELSE GREATEST(0, LEAST(
                 w.asked,
                 CASE WHEN w.gcap IS NOT NULL THEN w.gcap - (SELECT count(*) FROM (
                     SELECT 1 FROM jobs_job r WHERE r.state = 'running' AND r.name = w.name
                     LIMIT w.gcap{{released}}) running)::int{{unreleased}} END,
                 floor(LEAST(w.burst, g.tokens + w.rate * {_SINCE.format("g.refilled_at")}))::int
             )) END AS lim
    FROM wanted w LEFT JOIN gate g ON g.name = w.name
)"""

# In a statement that also ends jobs (FlowForm.releasing), the places they hold are free at
# its commit: counted as running in its snapshot, they are taken off the counts.
_RELEASED = " + (SELECT count(*) FROM written wr WHERE wr.wname = w.name)"
_UNRELEASED = " + (SELECT count(*) FROM written wr WHERE wr.wname = w.name)::int"  # room back
_TENANT_UNRELEASED = (
    " - (SELECT count(*) FROM written wr WHERE wr.wname = w.name AND wr.wtenant = r.tenant)::int"
)


def gate(flows: FlowForm) -> str:
    """The gate's CTEs for this form (:data:`GATE` or :data:`NO_GATE`)."""
    if not flows.gated:
        return NO_GATE
    releasing = flows.releasing
    return GATE.replace("{released}", _RELEASED if releasing else "").replace(
        "{unreleased}", _UNRELEASED if releasing else ""
    )


def tenant_rows(*, limited: bool, releasing: bool = False) -> str:
    """:data:`TENANT_ROWS`: with ``limited``, each tenant's room is bounded by its tenant
    limit and bucket (:data:`TENANT_ROOM`; ``releasing`` as in :class:`FlowForm`); without,
    by the claim's budget alone, and the running jobs are not read."""
    if not limited:
        return TENANT_ROWS.replace("{busy}", "").replace("{room}", "(SELECT n FROM budget)")
    busy = TENANT_BUSY.replace("{tenant_unreleased}", _TENANT_UNRELEASED if releasing else "")
    return TENANT_ROWS.replace("{busy}", busy).replace("{room}", TENANT_ROOM)


# No name takes a gate: each name's room is what it asks.
NO_GATE = """
room AS MATERIALIZED (
    SELECT w.name, w.cap, w.ord, w.tcap, w.trate, w.tburst, w.ordered, w.after, w.lshare,
        w.asked AS lim
    FROM wanted w
)"""

#: A tenant-limited name's running jobs by tenant (for :data:`TENANT_ROOM`).
TENANT_BUSY = """busy AS MATERIALIZED (
    SELECT r.tenant, count(*)::int{tenant_unreleased} AS n FROM jobs_job r
    WHERE w.tcap IS NOT NULL AND r.state = 'running' AND r.name = w.name
    GROUP BY r.tenant
),
"""

#: A tenant's room in a claim of a name with tenant limits: the claim's budget, within the
#: tenant's free places and its bucket's tokens.
TENANT_ROOM = (
    """GREATEST(0, LEAST(
                (SELECT n FROM budget),
                w.tcap - COALESCE((SELECT b.n FROM busy b WHERE b.tenant = c.tenant), 0),
                COALESCE((SELECT floor(LEAST(w.tburst, tb.tokens + w.trate * """
    + _SINCE.format("tb.refilled_at")
    + """))::int
                 FROM jobs_flowtenant tb WHERE tb.name = w.name AND tb.tenant = c.tenant),
                 floor(w.tburst)::int)
            ))"""
)

#: A tenant's room, as far as its due rows go (counted up to the claim's limit, unlocked):
#: what a tenant cannot use goes to the other tenants in round two.
AVAIL = """LEAST(t.room, (
        SELECT count(*) FROM (
            SELECT 1 FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = t.tenant{level}
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
              AND {paused}
            -- In the per-tenant index's order, so the planner reads the index, not the heap
            -- (whose claimed rows a scan in table order would step over first).
            ORDER BY j.priority DESC, j.run_after, j.id
            LIMIT LEAST(t.room, w.lim)) due)::int)"""

#: The tenants with queued rows of a tenant-ordered name (``w``), in the worker's rotation:
#: below its cursor (``w.after``), then from the highest down to it, one index hop each
#: (``ahead``, then ``behind``), evaluated only as far as what reads them asks.
WALK = """ahead(tenant) AS (
    (SELECT j.tenant FROM jobs_job j
     WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant < w.after
     ORDER BY j.tenant DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT j.tenant FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant < a.tenant
            ORDER BY j.tenant DESC LIMIT 1)
    FROM ahead a WHERE a.tenant IS NOT NULL
),
behind(tenant) AS (
    (SELECT j.tenant FROM jobs_job j
     WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant >= w.after
     ORDER BY j.tenant DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT j.tenant FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant < b.tenant
              AND j.tenant >= w.after
            ORDER BY j.tenant DESC LIMIT 1)
    FROM behind b WHERE b.tenant IS NOT NULL
),
"""

# A tenant-ordered name's due rows (``w`` is its room row): the tenants with queued rows,
# in the worker's scope (a scope is a condition on the tenant, so it is applied to the list),
# below the worker's cursor and then from the highest, one index hop each (landing on the
# end of a tenant's range, where its claimed jobs left no dead entries) and only as many as
# the claim may use; each one's room and due rows (counted up to the claim's limit, unlocked);
# weighted max-min fair shares; then each tenant's share of rows in cursor order, locked as
# pulled.
TENANT_ROWS = (
    """
WITH RECURSIVE {top}budget AS MATERIALIZED (SELECT {budget} AS n),
"""
    + WALK
    + """{busy}tenants AS MATERIALIZED (
    SELECT * FROM (
    SELECT t.tenant, t.pass, t.weight,
        -- One tenant read: its share is its room, and the pull stops at its due rows.
        CASE WHEN t.several THEN """
    + AVAIL
    + """ ELSE t.room END AS avail
    FROM (
        -- Whether another tenant is listed, from its neighbours: a count of the list would
        -- walk every tenant of the type before the first is served.
        SELECT c.tenant, c.pass,
            (lag(c.tenant) OVER () IS NOT NULL OR lead(c.tenant) OVER () IS NOT NULL)
                AS several,
            COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = c.tenant), 1)
                AS weight,
            {room} AS room
        FROM (SELECT tenant, 1 AS pass FROM ahead WHERE tenant IS NOT NULL
              UNION ALL
              SELECT tenant, 2 FROM behind WHERE tenant IS NOT NULL) c
        WHERE c.tenant || '' <> ALL((SELECT tenants FROM paused)::text[]) AND {tenant_scope}
    ) t
    WHERE t.room > 0
    -- Not pulled up into the filter below, which would count each tenant's rows again.
    OFFSET 0
    ) r
    -- Only tenants with a job this claim could start take a place among the tenants read.
    WHERE r.avail > 0
    LIMIT GREATEST((SELECT n FROM budget), 1)
),
-- The claim's budget shared by weight, max-min fair (water-filling): in order of due jobs
-- per weight, a tenant that cannot fill its part of what is left takes all it has, and the
-- others share the rest by weight, in whole jobs, the remainder one each in cursor order.
ranked AS (
    SELECT tenant, pos, weight, avail,
        sum(avail) OVER fill - avail AS used_before,
        sum(weight) OVER (ORDER BY avail::float8 / weight, pos
                          ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS weight_from
    FROM (SELECT tenant, weight, avail, row_number() OVER (ORDER BY pass, tenant DESC) AS pos
          FROM tenants) t
    WINDOW fill AS (ORDER BY avail::float8 / weight, pos ROWS UNBOUNDED PRECEDING)
),
filled AS (
    SELECT tenant, pos, weight, avail,
        avail::float8 * weight_from <= ((SELECT n FROM budget) - used_before)::float8 * weight
            AS full_share
    FROM ranked
),
spread AS (
    SELECT tenant, pos, weight, avail, full_share,
        (SELECT n FROM budget) - COALESCE(sum(avail) FILTER (WHERE full_share) OVER (), 0)
            AS spare,
        sum(weight) FILTER (WHERE NOT full_share) OVER () AS open_weight
    FROM filled
),
parts AS (
    SELECT tenant, pos, full_share, spare,
        CASE WHEN full_share THEN avail
             ELSE floor(spare::float8 * weight / open_weight)::int END AS part,
        row_number() OVER (PARTITION BY full_share ORDER BY pos) AS open_pos
    FROM spread
),
shares AS (
    SELECT tenant, pos, part + (NOT full_share AND open_pos
        <= spare - COALESCE(sum(part) FILTER (WHERE NOT full_share) OVER (), 0))::int AS share
    FROM parts
),
fair_rows AS MATERIALIZED (
SELECT due.id FROM (SELECT * FROM shares ORDER BY pos) s
CROSS JOIN LATERAL (
    SELECT j.id FROM jobs_job j
    WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = s.tenant{level}
      AND j.run_after <= statement_timestamp()
      AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
      AND {paused}
    ORDER BY j.priority DESC, j.run_after, j.id
    LIMIT s.share
    FOR UPDATE SKIP LOCKED
) due
WHERE s.share > 0
)
{low_rows}SELECT id FROM fair_rows{fill}
"""
)


#: Whether the tenant of a row ``{alias}`` has a job this claim could start: one probe of
#: the per-tenant index, backwards from the end of its due range (the latest due job), since
#: the entries of the jobs the last claims took lie at its start until vacuum removes them.
HAS_DUE = """COALESCE((
        SELECT TRUE FROM jobs_job j
        WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = {alias}.tenant{level}
          AND j.run_after <= statement_timestamp()
          AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
          AND {paused}
        ORDER BY j.priority, j.run_after DESC, j.id DESC
        LIMIT 1), FALSE)"""

#: How many accounts at rest-to-be one claim reads past, beyond its budget: a backlog that
#: drained leaves every account it had at the bottom of the order, and they are put to rest a
#: few claims at a time rather than all by one.
RESTING_READS = 16

# A fair name's due rows (``w`` is its room row) when its shares are kept over time (a fair
# type without tenant limits). Each tenant in play has an account (jobs_fairaccount): its
# starts so far, each counted as 1/weight (``served``). A claim serves the least served first,
# start by start: of the due jobs of the tenants it reads, it takes the ``n`` whose places
# come first, a tenant's k-th job standing at ``served + (k - 1) / weight`` (stride
# scheduling), so over any run of claims each tenant's starts follow its weight, whatever the
# claims' sizes. The claim's statement then adds its starts to the accounts
# (:data:`_AFTER_ACCOUNTS`).
#
# The tenants read: the accounts in play, least served first, up to the first ``n`` whose
# tenant has a job due (one index hop each, so however many tenants the type has, and at
# most RESTING_READS more); those of the worker's tenants read on the way with nothing due
# come to rest (their ``served`` is cleared), so a tenant that went quiet banks no credit and
# holds up no claim. Then the worker's rotation (as the claim of a tenant-limited type walks
# it, ``n`` tenants), for tenants without an account in play: each comes into play level with
# the least served account, so a new tenant's first jobs start in the claim that finds it.
# The function returns the rows to claim, then one row per tenant to write: its level before
# the claim (``base``) or that it comes to rest.
FAIR_ROWS = (
    """
WITH RECURSIVE {top}budget AS MATERIALIZED (SELECT {budget} AS n),
owed(served, tenant, mine, due, found, seen) AS (
    (SELECT s.served, s.tenant, s.mine, s.mine AND """
    + HAS_DUE.replace("{alias}", "s")
    + """, 0, 1
     FROM (SELECT s.served, s.tenant, {account_scope} AS mine
           FROM jobs_fairaccount s
           WHERE s.name = w.name AND s.served IS NOT NULL AND (SELECT n FROM budget) > 0
           ORDER BY s.served, s.tenant LIMIT 1) s)
    UNION ALL
    SELECT x.served, x.tenant, x.mine, x.mine AND """
    + HAS_DUE.replace("{alias}", "x")
    + """,
        o.found + o.due::int, o.seen + 1
    FROM owed o CROSS JOIN LATERAL (
        -- A hop along the index alone, the worker's scope tested on the account found: as a
        -- condition of the hop, the planner takes the scope for one that keeps hardly any
        -- row, and reads every account of the type to sort them.
        SELECT s.served, s.tenant, {account_scope} AS mine
        FROM jobs_fairaccount s
        WHERE s.name = w.name AND s.served IS NOT NULL
          AND (s.served, s.tenant) > (o.served, o.tenant)
        ORDER BY s.served, s.tenant LIMIT 1
    ) x
    WHERE o.found + o.due::int < (SELECT n FROM budget)
      AND o.seen < (SELECT n FROM budget) + """
    + str(RESTING_READS)
    + """
),
"""
    + WALK
    + """-- The rotation's tenants, as many as the claim takes jobs, of those in play (their level,
-- ``served``) or with a due job (the others are passed over, as a claim of a tenant-limited
-- type passes them). One that comes to rest now is out of play.
walked AS MATERIALIZED (
    SELECT c.tenant, c.pass, c.served FROM (
        SELECT c.tenant, c.pass, (
            -- By key (a NULL ``served`` is out of play too): with ``served IS NOT NULL`` the
            -- planner reads the type's accounts in the order index instead.
            SELECT s.served FROM jobs_fairaccount s
            WHERE s.name = w.name AND s.tenant = c.tenant
              AND NOT EXISTS (SELECT FROM owed o WHERE o.tenant = c.tenant AND o.mine AND NOT o.due)
        ) AS served
        FROM (
            SELECT tenant, 1 AS pass FROM ahead WHERE tenant IS NOT NULL
            UNION ALL
            SELECT tenant, 2 FROM behind WHERE tenant IS NOT NULL
        ) c
        WHERE c.tenant || '' <> ALL((SELECT tenants FROM paused)::text[]) AND {tenant_scope}
        -- Not pulled up into the filter below, which would look each account up again.
        OFFSET 0
    ) c
    WHERE CASE WHEN c.served IS NOT NULL THEN TRUE ELSE """
    + HAS_DUE.replace("{alias}", "c")
    + """ END
    LIMIT (SELECT n FROM budget)
),
-- Where an account comes into play: level with the least served of those with a due job
-- (else of those read, else of the type's).
level AS MATERIALIZED (
    SELECT COALESCE(
        (SELECT min(o.served) FILTER (WHERE o.due) FROM owed o),
        (SELECT min(o.served) FILTER (WHERE o.mine) FROM owed o),
        (SELECT s.served FROM jobs_fairaccount s
         WHERE s.name = w.name AND s.served IS NOT NULL ORDER BY s.served LIMIT 1),
        0) AS served
),
-- The tenants the claim's places go to: the least served in play with a due job; those the
-- rotation found not in play; and, when the first are fewer than the claim's places (the
-- accounts read were out of the worker's scope or at rest), those it found in play.
candidates AS MATERIALIZED (
    SELECT c.tenant, c.base, c.pass,
        COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = c.tenant), 1)
            AS weight
    FROM (
        SELECT o.tenant, o.served AS base,
            CASE WHEN o.tenant < w.after THEN 1 ELSE 2 END AS pass
        FROM owed o WHERE o.due
        UNION ALL
        SELECT k.tenant, (SELECT served FROM level), k.pass FROM walked k WHERE k.served IS NULL
        UNION ALL
        SELECT k.tenant, k.served, k.pass FROM walked k
        WHERE k.served IS NOT NULL
          AND (SELECT count(*) FROM owed o WHERE o.due) < (SELECT n FROM budget)
          AND NOT EXISTS (SELECT FROM owed o WHERE o.tenant = k.tenant)
          AND """
    + HAS_DUE.replace("{alias}", "k")
    + """
    ) c
),
-- No place past the n-th lowest level among the candidates is taken (each has a place
-- there): a tenant can take at most its places up to it, and its due jobs are counted only
-- that far (with many tenants level, one or two).
reach AS MATERIALIZED (
    SELECT (SELECT c.base FROM candidates c ORDER BY c.base
            LIMIT 1 OFFSET GREATEST((SELECT n FROM budget) - 1, 0)) AS base
),
tenants AS MATERIALIZED (
    SELECT c.tenant, c.base, c.weight,
        row_number() OVER (ORDER BY c.pass, c.tenant DESC) AS pos,
        -- One tenant read: its share is the budget, and the pull stops at its due rows. One
        -- place: the tenant has a due job (that is how it was read).
        CASE WHEN (SELECT count(*) FROM candidates) = 1 THEN (SELECT n FROM budget)
             WHEN c.places = 1 THEN 1
             ELSE (
            SELECT count(*) FROM (
                SELECT 1 FROM jobs_job j
                WHERE j.state = 'queued' AND j.fair AND j.name = w.name
                  AND j.tenant = c.tenant{level}
                  AND j.run_after <= statement_timestamp()
                  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
                  AND {paused}
                ORDER BY j.priority DESC, j.run_after, j.id
                LIMIT c.places) due)::int END AS avail
    FROM (
        SELECT c.*, CASE WHEN r.base IS NULL THEN (SELECT n FROM budget)
                         ELSE LEAST((SELECT n FROM budget),
                                    floor((r.base - c.base) * c.weight + 1e-9)::int + 1) END
            AS places
        FROM candidates c CROSS JOIN reach r
    ) c
    WHERE c.places > 0
),
-- Each due job's place, its tenant's k-th at base + (k - 1) / weight: the claim takes the
-- first n places (ties in rotation order).
shares AS (
    SELECT p.tenant, min(p.pos) AS pos, count(*)::int AS share FROM (
        SELECT t.tenant, t.pos FROM tenants t
        CROSS JOIN LATERAL generate_series(0, LEAST(t.avail, (SELECT n FROM budget)) - 1) AS g(k)
        ORDER BY t.base + g.k::float8 / t.weight, t.pos
        LIMIT (SELECT n FROM budget)
    ) p
    GROUP BY p.tenant
),
fair_rows AS MATERIALIZED (
SELECT due.id FROM (SELECT * FROM shares ORDER BY pos) s
CROSS JOIN LATERAL (
    SELECT j.id FROM jobs_job j
    WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = s.tenant{level}
      AND j.run_after <= statement_timestamp()
      AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
      AND {paused}
    ORDER BY j.priority DESC, j.run_after, j.id
    LIMIT s.share
    FOR UPDATE SKIP LOCKED
) due
),
picked AS (
    SELECT p.id FROM (
{low_rows}SELECT id FROM fair_rows{fill}
    ) p
    LIMIT w.lim
)
SELECT id, NULL::text, NULL::float8, NULL::integer FROM picked
UNION ALL
-- The accounts to write: those that took a share (their starts are the claimed jobs of the
-- top class), and those at rest from now on (no level).
SELECT NULL, t.tenant, t.base, (SELECT priority FROM top)
FROM tenants t WHERE EXISTS (SELECT FROM shares s WHERE s.tenant = t.tenant)
UNION ALL
SELECT NULL, o.tenant, NULL, NULL FROM owed o WHERE o.mine AND NOT o.due
"""
)


# A fair type without tenant limits is fair within its highest priority that has due jobs:
# a higher class is served first, and the claim's room its tenants leave is filled in the
# plain order from the classes below. A type with ``lower_priority_share`` keeps that share
# of each claim for the due jobs below the top class first (:data:`LOW`).
#: The priorities a name (``w.name``) has queued rows at, highest first: one hop down the
#: claim index each, evaluated only as far as what reads it asks. The claim's priority walk
#: (jobs.queue.claim) is this too.
LEVELS = """levels(priority) AS (
    (SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = w.name
     ORDER BY j.priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT j.priority FROM jobs_job j
            WHERE j.state = 'queued' AND j.name = w.name AND j.priority < l.priority
            ORDER BY j.priority DESC LIMIT 1)
    FROM levels l WHERE l.priority IS NOT NULL
)"""
#: The top class (``top``): the highest priority with a due row, found without reading the
#: start of the claim index where it can be helped, because the entries of the jobs the last
#: claims took stay there until vacuum and each must be checked in the table. The lowest
#: queued priority is read from the other end; the classes above it are walked as
#: :data:`LEVELS` walks, one hop each, down to the first with a due row. With one class
#: (the common case) the walk stops at its first hop, which bounds the range above it, and
#: that class is the top whether its rows are due or not (if none is, nothing is).
TOP_LEVEL = """lowest AS MATERIALIZED (
    SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = w.name
    ORDER BY j.priority LIMIT 1
),
above(priority) AS (
    (SELECT j.priority FROM jobs_job j
     WHERE j.state = 'queued' AND j.name = w.name AND j.priority > (SELECT priority FROM lowest)
     ORDER BY j.priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT j.priority FROM jobs_job j
            WHERE j.state = 'queued' AND j.name = w.name AND j.priority < a.priority
              AND j.priority > (SELECT priority FROM lowest)
            ORDER BY j.priority DESC LIMIT 1)
    FROM above a WHERE a.priority IS NOT NULL
),
top AS MATERIALIZED (
    SELECT COALESCE((
        SELECT a.priority FROM above a
        -- A scalar subquery with its own LIMIT, which the planner cannot turn into a join
        -- over the type's whole backlog.
        WHERE a.priority IS NOT NULL AND (
            SELECT TRUE FROM jobs_job j
            WHERE j.state = 'queued' AND j.name = w.name AND j.priority = a.priority
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
              AND {scope}
              AND {paused}
            -- In the claim index's order, so the planner reads the index, not the heap.
            ORDER BY j.priority DESC, j.run_after, j.id
            LIMIT 1)
        LIMIT 1), (SELECT priority FROM lowest)) AS priority
),
"""

#: Of a claim (``w.lim``) with a share for lower classes, the places kept for them: whole
#: places and, for the fraction, one more that often, so small claims keep the share too.
RESERVE = "floor(w.lim * COALESCE(w.lshare, 0) + random())::int"
#: The kept places' jobs: the due rows below the top class, up to the reserve (``{due}``).
LOW = (
    """reserve AS MATERIALIZED (SELECT """
    + RESERVE
    + """ AS n),
low AS MATERIALIZED (
    SELECT b.id FROM ({due}
    ) b
    LIMIT (SELECT n FROM reserve)
),
"""
)
#: A tenant-ordered claim's budget after the kept places.
LOW_BUDGET = "w.lim - (SELECT count(*) FROM low)::int"
LOW_ROWS = "SELECT id FROM low\nUNION ALL\n"
NOT_LOW = "\n  AND j.id <> ALL(ARRAY(SELECT id FROM low))"
TOP_LEVEL_ROWS = "\n              AND j.priority = (SELECT priority FROM top)"
#: The plain due rows below the top class (the claim's due-rows text, ``{due}``).
FILL = """
UNION ALL
SELECT f.id FROM ({due}
) f"""
BELOW_TOP = "\n  AND j.priority < (SELECT priority FROM top)"


def narrowed(due: str, condition: str) -> str:
    """The claim's due rows (``due``) with one more ``condition`` on them."""
    return due.replace("\n  AND j.name = w.name", "\n  AND j.name = w.name" + condition)


# The first hop of the priority walk (:data:`LEVELS`), as the claim's due rows hold it.
_FIRST_HOP = "AND j.name = w.name\n     ORDER BY j.priority DESC LIMIT 1)"


def below_top(due: str) -> str:
    """The claim's due rows (``due``) below the top class. In the priority walk's form its
    first hop starts below the top class too: from the start of the claim index it would
    cross the entries the top class's claimed jobs left there, every claim that reads them."""
    if "levels(priority)" in due and _FIRST_HOP not in due:
        raise AssertionError("the priority walk's first hop is not where below_top looks")
    return narrowed(due, BELOW_TOP).replace(
        _FIRST_HOP,
        _FIRST_HOP.replace("w.name", "w.name AND j.priority < (SELECT priority FROM top)"),
    )


# After the claim (``claimed``, its RETURNING rows): a gated name that started jobs bumps its
# gate's version and takes the tokens from its bucket; each tenant bucket likewise.
_AFTER_GATES = f"""
flow_gates AS (
    UPDATE jobs_flow f
    SET version = f.version + 1,
        tokens = LEAST(w.burst, f.tokens + w.rate * {_SINCE.format("f.refilled_at")}) - n.started,
        refilled_at = statement_timestamp()
    FROM (SELECT c.name, count(*) AS started FROM claimed c GROUP BY c.name) n
    JOIN wanted w ON w.name = n.name
    WHERE f.name = n.name AND w.gated
    RETURNING f.name
)"""
_AFTER_TENANTS = f"""
flow_tenants AS (
    INSERT INTO jobs_flowtenant (name, tenant, tokens, refilled_at)
    SELECT n.name, n.tenant,
        LEAST(w.tburst, tb.tokens + w.trate * {_SINCE.format("tb.refilled_at")}) - n.started,
        statement_timestamp()
    FROM (SELECT c.name, c.tenant, count(*) AS started FROM claimed c GROUP BY 1, 2) n
    JOIN wanted w ON w.name = n.name AND w.trate IS NOT NULL
    LEFT JOIN jobs_flowtenant tb ON tb.name = n.name AND tb.tenant = n.tenant
    ON CONFLICT (name, tenant) DO UPDATE
    SET tokens = EXCLUDED.tokens, refilled_at = EXCLUDED.refilled_at
    RETURNING name
)"""


# After the claim of a fair name without tenant limits: each tenant's account takes the
# claim's starts of it in the top class (those of the fill below it are the plain order's),
# at 1/weight each, counted from the level the pick read (``base``), or from what the account
# holds now if another claim has added to it since; an account the pick found with nothing
# due comes to rest. One INSERT in (name, tenant) order: the rows are locked in one order by
# every claim, so two claims never wait for each other in a cycle (they wait only for the
# other's commit when both started jobs of one tenant).
_AFTER_ACCOUNTS = """
fair_accounts AS (
    INSERT INTO jobs_fairaccount AS a (name, tenant, served, starts)
    SELECT e.name, e.tenant, e.base + e.started::float8 / e.weight, e.started
    FROM (
        SELECT fp.name, fp.tenant, fp.base, COALESCE(n.started, 0) AS started,
            COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = fp.tenant), 1)
                AS weight
        FROM fair_pick fp
        LEFT JOIN (
            SELECT c.{name} AS name, c.{tenant} AS tenant, c.{priority} AS priority,
                count(*) AS started
            FROM claimed c GROUP BY 1, 2, 3
        ) n ON n.name = fp.name AND n.tenant = fp.tenant AND n.priority = fp.top
        WHERE fp.id IS NULL
    ) e
    WHERE e.base IS NULL OR e.started > 0
    ORDER BY e.name, e.tenant
    ON CONFLICT (name, tenant) DO UPDATE
    SET served = CASE WHEN EXCLUDED.served IS NOT NULL THEN GREATEST(
            a.served + EXCLUDED.starts::float8 / COALESCE(
                (SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = a.tenant), 1),
            EXCLUDED.served) END,
        starts = a.starts + EXCLUDED.starts
)"""

#: The claim's RETURNING columns the accounts' write reads, as :sql:`claimed` names them in
#: the inline statement (the worker's pass function names them otherwise).
CLAIMED_COLUMNS = {"name": "name", "tenant": "tenant", "priority": "priority"}


def after_claim(flows: FlowForm, claimed: Mapping[str, str] = CLAIMED_COLUMNS) -> str:
    """The CTEs that follow the claim's UPDATE for this form ("" when none is needed);
    ``claimed`` names the claimed rows' columns (:data:`CLAIMED_COLUMNS`)."""
    parts = [_AFTER_GATES] if flows.gated else []
    if flows.tenant_rated:
        parts.append(_AFTER_TENANTS)
    if flows.tiered:
        parts.append(_AFTER_ACCOUNTS.format(**claimed))
    return "".join("," + part for part in parts)


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


# Reads for the console and the gauges duty (jobs.admin.flow, jobs.scheduler.gauges) --------


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
