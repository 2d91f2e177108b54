-- Rendered from jobs/queue/claim.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).
CREATE OR REPLACE FUNCTION jobs_fair_pick_v2(
    p_name text, p_lim integer, p_cap integer, p_after text, p_lshare float8,
    p_queues text[], p_tenants text[], p_tenant text, p_component text
) RETURNS TABLE (r_id bigint, r_tenant text, r_base float8, r_top integer)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
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
    owed(served, tenant, mine, due, found, seen) AS (
        (SELECT s.served, s.tenant, s.mine, s.mine AND COALESCE((
            SELECT TRUE FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = s.tenant
                  AND j.priority = (SELECT priority FROM top)
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
              AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
            ORDER BY j.priority, j.run_after DESC, j.id DESC
            LIMIT 1), FALSE), 0, 1
         FROM (SELECT s.served, s.tenant, (p_tenant IS NULL OR s.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = s.tenant AND o.component = p_component)) AS mine
               FROM jobs_fairaccount s
               WHERE s.name = p_name AND s.served IS NOT NULL AND (SELECT n FROM budget) > 0
               ORDER BY s.served, s.tenant LIMIT 1) s)
        UNION ALL
        SELECT x.served, x.tenant, x.mine, x.mine AND COALESCE((
            SELECT TRUE FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = x.tenant
                  AND j.priority = (SELECT priority FROM top)
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
              AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
            ORDER BY j.priority, j.run_after DESC, j.id DESC
            LIMIT 1), FALSE),
            o.found + o.due::int, o.seen + 1
        FROM owed o CROSS JOIN LATERAL (
            -- A hop along the index alone, the worker's scope tested on the account found: as a
            -- condition of the hop, the planner takes the scope for one that keeps hardly any
            -- row, and reads every account of the type to sort them.
            SELECT s.served, s.tenant, (p_tenant IS NULL OR s.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = s.tenant AND o.component = p_component)) AS mine
            FROM jobs_fairaccount s
            WHERE s.name = p_name AND s.served IS NOT NULL
              AND (s.served, s.tenant) > (o.served, o.tenant)
            ORDER BY s.served, s.tenant LIMIT 1
        ) x
        WHERE o.found + o.due::int < (SELECT n FROM budget)
          AND o.seen < (SELECT n FROM budget) + 16
    ),
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
    -- The rotation's tenants, as many as the claim takes jobs, of those in play (their level,
    -- ``served``) or with a due job (the others are passed over, as a claim of a tenant-limited
    -- type passes them). One that comes to rest now is out of play.
    walked AS MATERIALIZED (
        SELECT c.tenant, c.pass, c.served FROM (
            SELECT c.tenant, c.pass, (
                -- By key (a NULL ``served`` is out of play too): with ``served IS NOT NULL`` the
                -- planner reads the type's accounts in the order index instead.
                SELECT s.served FROM jobs_fairaccount s
                WHERE s.name = p_name AND s.tenant = c.tenant
                  AND NOT EXISTS (SELECT FROM owed o WHERE o.tenant = c.tenant AND o.mine AND NOT o.due)
            ) AS served
            FROM (
                SELECT tenant, 1 AS pass FROM ahead WHERE tenant IS NOT NULL
                UNION ALL
                SELECT tenant, 2 FROM behind WHERE tenant IS NOT NULL
            ) c
            WHERE c.tenant || '' <> ALL(p_tenants::text[]) AND (p_tenant IS NULL OR c.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = c.tenant AND o.component = p_component))
            -- Not pulled up into the filter below, which would look each account up again.
            OFFSET 0
        ) c
        WHERE CASE WHEN c.served IS NOT NULL THEN TRUE ELSE COALESCE((
            SELECT TRUE FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = c.tenant
                  AND j.priority = (SELECT priority FROM top)
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
              AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
            ORDER BY j.priority, j.run_after DESC, j.id DESC
            LIMIT 1), FALSE) END
        LIMIT (SELECT n FROM budget)
    ),
    -- Where an account comes into play: level with the least served of those with a due job
    -- (else of those read, else of the type's).
    level AS MATERIALIZED (
        SELECT COALESCE(
            (SELECT min(o.served) FILTER (WHERE o.due) FROM owed o),
            (SELECT min(o.served) FILTER (WHERE o.mine) FROM owed o),
            (SELECT s.served FROM jobs_fairaccount s
             WHERE s.name = p_name AND s.served IS NOT NULL ORDER BY s.served LIMIT 1),
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
                CASE WHEN o.tenant < p_after THEN 1 ELSE 2 END AS pass
            FROM owed o WHERE o.due
            UNION ALL
            SELECT k.tenant, (SELECT served FROM level), k.pass FROM walked k WHERE k.served IS NULL
            UNION ALL
            SELECT k.tenant, k.served, k.pass FROM walked k
            WHERE k.served IS NOT NULL
              AND (SELECT count(*) FROM owed o WHERE o.due) < (SELECT n FROM budget)
              AND NOT EXISTS (SELECT FROM owed o WHERE o.tenant = k.tenant)
              AND COALESCE((
            SELECT TRUE FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = k.tenant
                  AND j.priority = (SELECT priority FROM top)
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
              AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
            ORDER BY j.priority, j.run_after DESC, j.id DESC
            LIMIT 1), FALSE)
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
                    WHERE j.state = 'queued' AND j.fair AND j.name = p_name
                      AND j.tenant = c.tenant
                  AND j.priority = (SELECT priority FROM top)
                      AND j.run_after <= statement_timestamp()
                      AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
                      AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
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
        WHERE j.state = 'queued' AND j.fair AND j.name = p_name AND j.tenant = s.tenant
                  AND j.priority = (SELECT priority FROM top)
          AND j.run_after <= statement_timestamp()
          AND j.attempts < LEAST(j.max_attempts, COALESCE(p_cap, j.max_attempts))
          AND NOT (j.queue || '' = ANY(p_queues::text[])) AND NOT (j.tenant || '' = ANY(p_tenants::text[]))
        ORDER BY j.priority DESC, j.run_after, j.id
        LIMIT s.share
        FOR UPDATE SKIP LOCKED
    ) due
    ),
    picked AS (
        SELECT p.id FROM (
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
        ) p
        LIMIT p_lim
    )
    SELECT id, NULL::text, NULL::float8, NULL::integer FROM picked
    UNION ALL
    -- The accounts to write: those that took a share (their starts are the claimed jobs of the
    -- top class), and those at rest from now on (no level).
    SELECT NULL, t.tenant, t.base, (SELECT priority FROM top)
    FROM tenants t WHERE EXISTS (SELECT FROM shares s WHERE s.tenant = t.tenant)
    UNION ALL
    SELECT NULL, o.tenant, NULL, NULL FROM owed o WHERE o.mine AND NOT o.due;
END
$$;
