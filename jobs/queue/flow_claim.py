"""The flow claim's SQL, part one: what each name asks, its gate, and the tenant-ordered rows.

The claim of names with flow controls (:mod:`jobs.queue.flow`) is assembled from these
fragments by :mod:`jobs.queue.claim`: :data:`WANTED` (each name's request and controls), the
gate (:func:`gate`: the gate rows locked at the version the snapshot saw, and each name's
room), the tenant order (:func:`tenant_rows`: the tenants walked from the worker's cursor,
each one's room and share), and what follows the claim (:func:`after_claim`: gate versions,
buckets and fair accounts written). The fair forms' fragments are in :mod:`jobs.queue.flow_fair`.
"""

from __future__ import annotations

from collections.abc import Mapping

from jobs.queue.flow import _SINCE, FlowForm

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
