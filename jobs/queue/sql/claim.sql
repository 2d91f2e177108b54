-- Rendered from jobs/queue/claim.py and jobs/queue/flow_claim.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).

-- name: claim
-- Names without flow controls, on PostgreSQL 18: for each name in the order asked, its
-- due rows in one ordered scan of the claim index, locked as the outer LIMIT pulls
-- them, then marked running with a fresh claim token and lease.
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(%(names)b::text[], %(limits)b::int[], %(caps)b::int[])
        WITH ORDINALITY AS w(name, lim, cap, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM wanted w
    CROSS JOIN LATERAL (
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
  AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED

    ) c
    LIMIT %(total)s
)

UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
;

-- name: claim_walk
-- The same before PostgreSQL 18, which cannot skip through an index: the due rows
-- of each priority that has queued rows, highest first, one hop down the index each.
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(%(names)b::text[], %(limits)b::int[], %(caps)b::int[])
        WITH ORDINALITY AS w(name, lim, cap, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM wanted w
    CROSS JOIN LATERAL (
-- The priorities this name has queued rows at, highest first: one hop down the claim index
-- each, evaluated only as far as the claim below asks.
WITH RECURSIVE levels(priority) AS (
    (SELECT j.priority FROM jobs_job j WHERE j.state = 'queued' AND j.name = w.name
     ORDER BY j.priority DESC LIMIT 1)
    UNION ALL
    SELECT (SELECT j.priority FROM jobs_job j
            WHERE j.state = 'queued' AND j.name = w.name AND j.priority < l.priority
            ORDER BY j.priority DESC LIMIT 1)
    FROM levels l WHERE l.priority IS NOT NULL
)
SELECT due.id FROM levels l
CROSS JOIN LATERAL (
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name
  AND j.priority = l.priority
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
  AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED
) due
LIMIT w.lim

    ) c
    LIMIT %(total)s
)

UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
;

-- name: claim_gated
-- Names with a fleet-wide limit (global_concurrency, rate_limit): each takes its gate
-- row, its room is what its limit and bucket leave, and the claim bumps the gate.
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(
        %(names)b::text[], %(limits)b::int[], %(caps)b::int[], %(gcaps)b::int[],
        %(tcaps)b::int[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[],
        %(tbursts)b::float8[], %(gated)b::bool[], %(ordered)b::bool[], %(afters)b::text[],
        %(lshares)b::float8[]
    ) WITH ORDINALITY AS w(name, asked, cap, gcap, tcap, rate, burst, trate, tburst, gated,
                           ordered, after, lshare, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
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
                     LIMIT w.gcap) running)::int END,
                 floor(LEAST(w.burst, g.tokens + w.rate * EXTRACT(EPOCH FROM statement_timestamp() - g.refilled_at)::float8))::int
             )) END AS lim
    FROM wanted w LEFT JOIN gate g ON g.name = w.name
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM room w
    CROSS JOIN LATERAL (
        SELECT d.id FROM (
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
  AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED

        ) d WHERE NOT w.ordered
    ) c
    WHERE w.lim > 0
    LIMIT %(total)s
)
, claimed AS (
UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
),
flow_gates AS (
    UPDATE jobs_flow f
    SET version = f.version + 1,
        tokens = LEAST(w.burst, f.tokens + w.rate * EXTRACT(EPOCH FROM statement_timestamp() - f.refilled_at)::float8) - n.started,
        refilled_at = statement_timestamp()
    FROM (SELECT c.name, count(*) AS started FROM claimed c GROUP BY c.name) n
    JOIN wanted w ON w.name = n.name
    WHERE f.name = n.name AND w.gated
    RETURNING f.name
)
SELECT * FROM claimed
;

-- name: claim_tenant_limited
-- Names with tenant limits (tenant_concurrency, tenant_rate_limit): read tenant by
-- tenant from the worker's cursor, each tenant's room within its limit and bucket,
-- shared max-min fair by weight; the tenants' buckets are written after the claim.
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(
        %(names)b::text[], %(limits)b::int[], %(caps)b::int[], %(gcaps)b::int[],
        %(tcaps)b::int[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[],
        %(tbursts)b::float8[], %(gated)b::bool[], %(ordered)b::bool[], %(afters)b::text[],
        %(lshares)b::float8[]
    ) WITH ORDINALITY AS w(name, asked, cap, gcap, tcap, rate, burst, trate, tburst, gated,
                           ordered, after, lshare, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
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
                     LIMIT w.gcap) running)::int END,
                 floor(LEAST(w.burst, g.tokens + w.rate * EXTRACT(EPOCH FROM statement_timestamp() - g.refilled_at)::float8))::int
             )) END AS lim
    FROM wanted w LEFT JOIN gate g ON g.name = w.name
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM room w
    CROSS JOIN LATERAL (
        SELECT t.id FROM (
WITH RECURSIVE budget AS MATERIALIZED (SELECT w.lim AS n),
ahead(tenant) AS (
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
busy AS MATERIALIZED (
    SELECT r.tenant, count(*)::int AS n FROM jobs_job r
    WHERE w.tcap IS NOT NULL AND r.state = 'running' AND r.name = w.name
    GROUP BY r.tenant
),
tenants AS MATERIALIZED (
    SELECT * FROM (
    SELECT t.tenant, t.pass, t.weight,
        -- One tenant read: its share is its room, and the pull stops at its due rows.
        CASE WHEN t.several THEN LEAST(t.room, (
        SELECT count(*) FROM (
            SELECT 1 FROM jobs_job j
            WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = t.tenant
              AND j.run_after <= statement_timestamp()
              AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
              AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
            -- In the per-tenant index's order, so the planner reads the index, not the heap
            -- (whose claimed rows a scan in table order would step over first).
            ORDER BY j.priority DESC, j.run_after, j.id
            LIMIT LEAST(t.room, w.lim)) due)::int) ELSE t.room END AS avail
    FROM (
        -- Whether another tenant is listed, from its neighbours: a count of the list would
        -- walk every tenant of the type before the first is served.
        SELECT c.tenant, c.pass,
            (lag(c.tenant) OVER () IS NOT NULL OR lead(c.tenant) OVER () IS NOT NULL)
                AS several,
            COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = c.tenant), 1)
                AS weight,
            GREATEST(0, LEAST(
                (SELECT n FROM budget),
                w.tcap - COALESCE((SELECT b.n FROM busy b WHERE b.tenant = c.tenant), 0),
                COALESCE((SELECT floor(LEAST(w.tburst, tb.tokens + w.trate * EXTRACT(EPOCH FROM statement_timestamp() - tb.refilled_at)::float8))::int
                 FROM jobs_flowtenant tb WHERE tb.name = w.name AND tb.tenant = c.tenant),
                 floor(w.tburst)::int)
            )) AS room
        FROM (SELECT tenant, 1 AS pass FROM ahead WHERE tenant IS NOT NULL
              UNION ALL
              SELECT tenant, 2 FROM behind WHERE tenant IS NOT NULL) c
        WHERE c.tenant || '' <> ALL((SELECT tenants FROM paused)::text[]) AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = c.tenant AND o.component = %(scope_component)s)
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
    WHERE j.state = 'queued' AND j.fair AND j.name = w.name AND j.tenant = s.tenant
      AND j.run_after <= statement_timestamp()
      AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
      AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
    ORDER BY j.priority DESC, j.run_after, j.id
    LIMIT s.share
    FOR UPDATE SKIP LOCKED
) due
WHERE s.share > 0
)
SELECT id FROM fair_rows

        ) t WHERE w.ordered AND (w.tcap IS NOT NULL OR w.trate IS NOT NULL)
    ) c
    WHERE w.lim > 0
    LIMIT %(total)s
)
, claimed AS (
UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
),
flow_gates AS (
    UPDATE jobs_flow f
    SET version = f.version + 1,
        tokens = LEAST(w.burst, f.tokens + w.rate * EXTRACT(EPOCH FROM statement_timestamp() - f.refilled_at)::float8) - n.started,
        refilled_at = statement_timestamp()
    FROM (SELECT c.name, count(*) AS started FROM claimed c GROUP BY c.name) n
    JOIN wanted w ON w.name = n.name
    WHERE f.name = n.name AND w.gated
    RETURNING f.name
),
flow_tenants AS (
    INSERT INTO jobs_flowtenant (name, tenant, tokens, refilled_at)
    SELECT n.name, n.tenant,
        LEAST(w.tburst, tb.tokens + w.trate * EXTRACT(EPOCH FROM statement_timestamp() - tb.refilled_at)::float8) - n.started,
        statement_timestamp()
    FROM (SELECT c.name, c.tenant, count(*) AS started FROM claimed c GROUP BY 1, 2) n
    JOIN wanted w ON w.name = n.name AND w.trate IS NOT NULL
    LEFT JOIN jobs_flowtenant tb ON tb.name = n.name AND tb.tenant = n.tenant
    ON CONFLICT (name, tenant) DO UPDATE
    SET tokens = EXCLUDED.tokens, refilled_at = EXCLUDED.refilled_at
    RETURNING name
)
SELECT * FROM claimed
;

-- name: claim_fair
-- Fair names without tenant limits: their rows and the tenants' accounts come from
-- jobs_fair_pick_v2, and the accounts are written after the claim. (The worker's pass
-- of such names is jobs_worker_fair_pass_v3, which holds this claim.)
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(
        %(names)b::text[], %(limits)b::int[], %(caps)b::int[], %(gcaps)b::int[],
        %(tcaps)b::int[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[],
        %(tbursts)b::float8[], %(gated)b::bool[], %(ordered)b::bool[], %(afters)b::text[],
        %(lshares)b::float8[]
    ) WITH ORDINALITY AS w(name, asked, cap, gcap, tcap, rate, burst, trate, tburst, gated,
                           ordered, after, lshare, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
room AS MATERIALIZED (
    SELECT w.name, w.cap, w.ord, w.tcap, w.trate, w.tburst, w.ordered, w.after, w.lshare,
        w.asked AS lim
    FROM wanted w
),
fair_pick AS MATERIALIZED (
    SELECT w.name, f.id, f.tenant, f.base, f.top
    FROM room w
    CROSS JOIN LATERAL jobs_fair_pick_v2(
        w.name, w.lim, w.cap, w.after, w.lshare,
        (SELECT queues FROM paused), (SELECT tenants FROM paused),
        %(pick_tenant)s::text, %(pick_component)s::text) AS f(id, tenant, base, top)
    WHERE w.lim > 0 AND w.ordered AND w.tcap IS NULL AND w.trate IS NULL
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM room w
    CROSS JOIN LATERAL (
        SELECT fp.id FROM fair_pick fp WHERE fp.name = w.name AND fp.id IS NOT NULL
    ) c
    WHERE w.lim > 0
    LIMIT %(total)s
)
, claimed AS (
UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
),
fair_accounts AS (
    INSERT INTO jobs_fairaccount AS a (name, tenant, served, starts)
    SELECT e.name, e.tenant, e.base + e.started::float8 / e.weight, e.started
    FROM (
        SELECT fp.name, fp.tenant, fp.base, COALESCE(n.started, 0) AS started,
            COALESCE((SELECT tw.weight FROM jobs_tenantweight tw WHERE tw.tenant = fp.tenant), 1)
                AS weight
        FROM fair_pick fp
        LEFT JOIN (
            SELECT c.name AS name, c.tenant AS tenant, c.priority AS priority,
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
)
SELECT * FROM claimed
;

-- name: claim_lower_share
-- Names with lower_priority_share: the share of the claim kept for the due jobs
-- below the top class first, then the plain order past them.
WITH
paused AS (
    SELECT COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'job_type'), '{}') AS names,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'queue'), '{}') AS queues,
           COALESCE(array_agg(p.value::text) FILTER (WHERE p.kind = 'tenant'), '{}') AS tenants
    FROM jobs_pause p
    -- A timed pause (a handler's throttle signal) ends by itself.
    WHERE p.until IS NULL OR p.until > statement_timestamp()
),
wanted AS (
    SELECT * FROM unnest(
        %(names)b::text[], %(limits)b::int[], %(caps)b::int[], %(gcaps)b::int[],
        %(tcaps)b::int[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[],
        %(tbursts)b::float8[], %(gated)b::bool[], %(ordered)b::bool[], %(afters)b::text[],
        %(lshares)b::float8[]
    ) WITH ORDINALITY AS w(name, asked, cap, gcap, tcap, rate, burst, trate, tburst, gated,
                           ordered, after, lshare, ord)
    WHERE w.name <> ALL((SELECT names FROM paused)::text[])
),
room AS MATERIALIZED (
    SELECT w.name, w.cap, w.ord, w.tcap, w.trate, w.tburst, w.ordered, w.after, w.lshare,
        w.asked AS lim
    FROM wanted w
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM room w
    CROSS JOIN LATERAL (
        (SELECT r.id FROM (
WITH RECURSIVE lowest AS MATERIALIZED (
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
              AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
              AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
            -- In the claim index's order, so the planner reads the index, not the heap.
            ORDER BY j.priority DESC, j.run_after, j.id
            LIMIT 1)
        LIMIT 1), (SELECT priority FROM lowest)) AS priority
),
reserve AS MATERIALIZED (SELECT floor(w.lim * COALESCE(w.lshare, 0) + random())::int AS n),
low AS MATERIALIZED (
    SELECT b.id FROM (
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name
  AND j.priority < (SELECT priority FROM top)
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
  AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED

    ) b
    LIMIT (SELECT n FROM reserve)
)
SELECT id FROM low
UNION ALL
SELECT p.id FROM (
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name
  AND j.id <> ALL(ARRAY(SELECT id FROM low))
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = %(scope_component)s)
  AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED

) p
        ) r WHERE NOT w.ordered
        LIMIT w.lim)
    ) c
    WHERE w.lim > 0
    LIMIT %(total)s
)

UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
;
