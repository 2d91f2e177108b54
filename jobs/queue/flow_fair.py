"""The flow claim's SQL, part two: fair types (accounts kept over time) and priority classes.

A fair type without tenant limits is served least-served tenant first, by its accounts
(:data:`FAIR_ROWS`), within its highest priority class that has due jobs (:data:`LEVELS`,
:data:`TOP_LEVEL`); ``lower_priority_share`` keeps a share of each claim for the classes below
(:data:`LOW`). :mod:`jobs.queue.claim` assembles these fragments with those of
:mod:`jobs.queue.flow_claim`.
"""

from __future__ import annotations

from jobs.queue.flow_claim import WALK

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
