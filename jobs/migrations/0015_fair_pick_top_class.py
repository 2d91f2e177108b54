"""The fair pick finds the top class without reading the claimed jobs' index entries.

``jobs_fair_pick`` found the highest priority with due jobs by walking the claim index from
its start, where the entries of the jobs the last claims took stay until vacuum: in a
drain, twice a claim over hundreds of entries checked in the table. It now reads the lowest
queued priority from the index's other end and walks only the classes above it, so a type
with one class finds it in two short reads.

``SQL`` is what ``jobs.queue.claim.fair_pick_function()`` returned when this migration was
written; a test compares them, so a change to the claim's SQL comes with a migration.
"""

from importlib import import_module

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION jobs_fair_pick(
    p_name text, p_lim integer, p_cap integer, p_after text, p_lshare float8,
    p_queues text[], p_tenants text[], p_tenant text, p_component text
) RETURNS SETOF bigint LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY SELECT picked.id FROM (
    WITH RECURSIVE lowest AS MATERIALIZED (
        SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = p_name
        ORDER BY j.priority LIMIT 1
    ),
    above(priority) AS (
        (SELECT j.priority FROM jobs_job j
         WHERE j.state = 'queued' AND j.name = p_name AND j.priority > (SELECT priority FROM lowest)
         ORDER BY j.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.priority FROM jobs_job j
                WHERE j.state = 'queued' AND j.name = p_name AND j.priority < a.priority
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
                WHERE j.state = 'queued' AND j.name = p_name AND j.priority = a.priority
                  AND j.run_after <= statement_timestamp()
                  AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
                  AND (p_tenant IS NULL OR j.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = p_component))
                  AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
                -- In the claim index's order, so the planner reads the index, not the heap.
                ORDER BY j.priority DESC, j.run_after, j.id
                LIMIT 1)
            LIMIT 1), (SELECT priority FROM lowest)) AS priority
    ),
    reserve AS MATERIALIZED (SELECT floor(p_lim * COALESCE(p_lshare, 0) + random())::int AS n),
    low AS MATERIALIZED (
        SELECT b.id FROM (
    -- The priorities this name has queued rows at, highest first: one hop down the claim index
    -- each, evaluated only as far as the claim below asks.
    WITH RECURSIVE levels(priority) AS (
        (SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = p_name AND j.priority < (SELECT priority FROM top)
         ORDER BY j.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.priority FROM jobs_job j
                WHERE j.state = 'queued' AND j.name = p_name AND j.priority < l.priority
                ORDER BY j.priority DESC LIMIT 1)
        FROM levels l WHERE l.priority IS NOT NULL
    )
    SELECT due.id FROM levels l
    CROSS JOIN LATERAL (
    SELECT j.id FROM jobs_job j
    WHERE j.state = 'queued'
      AND j.name = p_name
      AND j.priority < (SELECT priority FROM top)
      AND j.priority = l.priority
      AND j.run_after <= statement_timestamp()
      AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
      AND (p_tenant IS NULL OR j.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = p_component))
      AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
    ORDER BY j.priority DESC, j.run_after, j.id
    LIMIT p_lim
    FOR UPDATE SKIP LOCKED
    ) due
    LIMIT p_lim

        ) b
        LIMIT (SELECT n FROM reserve)
    ),
    budget AS MATERIALIZED (SELECT p_lim - (SELECT count(*) FROM low)::int AS n),
    ahead(tenant) AS (
        (SELECT j.tenant FROM jobs_job j
         WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant < p_after
         ORDER BY j.tenant DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant FROM jobs_job j
                WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant < a.tenant
                ORDER BY j.tenant DESC LIMIT 1)
        FROM ahead a WHERE a.tenant IS NOT NULL
    ),
    behind(tenant) AS (
        (SELECT j.tenant FROM jobs_job j
         WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant >= p_after
         ORDER BY j.tenant DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.tenant FROM jobs_job j
                WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant < b.tenant
                  AND j.tenant >= p_after
                ORDER BY j.tenant DESC LIMIT 1)
        FROM behind b WHERE b.tenant IS NOT NULL
    ),
    tenants AS MATERIALIZED (
        SELECT * FROM (
        SELECT t.tenant, t.pass, t.weight,
            -- One tenant read: its share is its room, and the pull stops at its due rows.
            CASE WHEN t.several THEN LEAST(t.room, (
            SELECT count(*) FROM (
                SELECT 1 FROM jobs_job j
                WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = t.tenant
                  AND j.priority = (SELECT priority FROM top)
                  AND j.run_after <= statement_timestamp()
                  AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
                  AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
                -- In the per-tenant index's order, so the planner reads the index, not the heap
                -- (whose claimed rows a scan in table order would step over first).
                ORDER BY j.priority DESC, j.run_after, j.id
                LIMIT LEAST(t.room, p_lim)) due)::int) ELSE t.room END AS avail
        FROM (
            -- Whether another tenant is listed, from its neighbours: a count of the list would
            -- walk every tenant of the type before the first is served.
            SELECT c.tenant, c.pass,
                (lag(c.tenant) OVER () IS NOT NULL OR lead(c.tenant) OVER () IS NOT NULL)
                    AS several,
                COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = c.tenant), 1)
                    AS weight,
                (SELECT n FROM budget) AS room
            FROM (SELECT tenant, 1 AS pass FROM ahead WHERE tenant IS NOT NULL
                  UNION ALL
                  SELECT tenant, 2 FROM behind WHERE tenant IS NOT NULL) c
            WHERE c.tenant || '' <> ALL(p_tenants::text[]) AND (p_tenant IS NULL OR c.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = c.tenant AND o.component = p_component))
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
        WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = s.tenant
                  AND j.priority = (SELECT priority FROM top)
          AND j.run_after <= statement_timestamp()
          AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
          AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
        ORDER BY j.priority DESC, j.run_after, j.id
        LIMIT s.share
        FOR UPDATE SKIP LOCKED
    ) due
    WHERE s.share > 0
    )
    SELECT id FROM low
    UNION ALL
    SELECT id FROM fair_rows
    UNION ALL
    SELECT f.id FROM (
    -- The priorities this name has queued rows at, highest first: one hop down the claim index
    -- each, evaluated only as far as the claim below asks.
    WITH RECURSIVE levels(priority) AS (
        (SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = p_name AND j.priority < (SELECT priority FROM top)
         ORDER BY j.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT j.priority FROM jobs_job j
                WHERE j.state = 'queued' AND j.name = p_name AND j.priority < l.priority
                ORDER BY j.priority DESC LIMIT 1)
        FROM levels l WHERE l.priority IS NOT NULL
    )
    SELECT due.id FROM levels l
    CROSS JOIN LATERAL (
    SELECT j.id FROM jobs_job j
    WHERE j.state = 'queued'
      AND j.name = p_name
      AND j.priority < (SELECT priority FROM top)
      AND j.id <> ALL(ARRAY(SELECT id FROM low))
      AND j.priority = l.priority
      AND j.run_after <= statement_timestamp()
      AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
      AND (p_tenant IS NULL OR j.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = p_component))
      AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
    ORDER BY j.priority DESC, j.run_after, j.id
    LIMIT p_lim
    FOR UPDATE SKIP LOCKED
    ) due
    LIMIT p_lim

    ) f
    ) picked LIMIT p_lim;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0014_fair_pick"),
    ]

    operations = [
        migrations.RunSQL(SQL, reverse_sql=import_module("jobs.migrations.0014_fair_pick").SQL)
    ]
