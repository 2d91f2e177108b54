-- Rendered from jobs/queue/cycle.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).

-- name: pass
-- The worker's pass for names without flow controls: its outcomes written and the
-- next jobs claimed in one call (functions/jobs_worker_pass_v3.sql), whose plan
-- each connection keeps. p_walk picks the claim's form for the server.
SELECT * FROM jobs_worker_pass_v3(%(walk)s, %(ids)b::bigint[], %(tokens)b::uuid[], %(states)b::text[], %(codes)b::text[], %(details)b::text[], %(delays)b::float8[], %(ats)b::timestamptz[], %(deltas)b::integer[], %(results)b::jsonb[], %(reports)b::jsonb[], %(names)b::text[], %(limits)b::integer[], %(caps)b::integer[], %(total)s::integer, %(lease)s::float8, %(worker)s::text, %(pick_tenant)s::text, %(pick_component)s::text)
;

-- name: fair_pass
-- The same for names all fair with no limit (functions/jobs_worker_fair_pass_v3.sql).
SELECT * FROM jobs_worker_fair_pass_v3(%(ids)b::bigint[], %(tokens)b::uuid[], %(states)b::text[], %(codes)b::text[], %(details)b::text[], %(delays)b::float8[], %(ats)b::timestamptz[], %(deltas)b::integer[], %(results)b::jsonb[], %(reports)b::jsonb[], %(names)b::text[], %(limits)b::integer[], %(caps)b::integer[], %(gcaps)b::integer[], %(tcaps)b::integer[], %(rates)b::float8[], %(bursts)b::float8[], %(trates)b::float8[], %(tbursts)b::float8[], %(gated)b::boolean[], %(ordered)b::boolean[], %(afters)b::text[], %(lshares)b::float8[], %(total)s::integer, %(lease)s::float8, %(worker)s::text, %(pick_tenant)s::text, %(pick_component)s::text)
;

-- name: pass_inline
-- The pass for other flow controls (here a fleet-wide limit) as one statement: the
-- outcome write, the claim (whose rooms count the jobs it ends as free), the gates'
-- update; then the claimed rows and one report row. Counted passes (outside the
-- worker) add the rollup's CTE.
WITH
o AS (
    -- Of two outcomes for one attempt, the later.
    SELECT DISTINCT ON (o.id, o.token) * FROM unnest(
        %(ids)b::bigint[], %(tokens)b::uuid[], %(states)b::text[], %(codes)b::text[],
        %(details)b::text[], %(delays)b::float8[], %(ats)b::timestamptz[], %(deltas)b::int[],
        %(results)b::jsonb[], %(reports)b::jsonb[]
    ) WITH ORDINALITY AS o(id, token, state, code, detail, delay, at, attempts_delta, result,
                           report, ord)
    ORDER BY o.id, o.token, o.ord DESC
),
free AS (
    -- An attempt an operator asked to stop is not retried or handed back: it ends cancelled.
    SELECT j.id, o.token, o.code, o.detail, o.delay, o.at, o.attempts_delta, o.result,
           o.report, j.batch_id, s.state,
           j.cancel_requested_at IS NOT NULL
               AND (o.state IN ('queued', 'cancelled')) AS stopped, l.leaves
    FROM jobs_job j JOIN o ON j.id = o.id
    CROSS JOIN LATERAL (
        SELECT CASE WHEN j.cancel_requested_at IS NOT NULL AND o.state = 'queued'
                    THEN 'cancelled' ELSE o.state END AS state
    ) s
    CROSS JOIN LATERAL (
        -- Ends, and leaves for the history: keyless, in no batch, waited for by none.
        SELECT s.state <> 'queued' AND NOT j.keyed AND j.batch_id IS NULL
               AND NOT j.depended_on AND s.state = ANY((SELECT COALESCE(array_agg(r.state::text), '{}') FROM jobs_historyready r WHERE r.until > statement_timestamp())::text[]) AS leaves
    ) l
    WHERE j.claim_token = o.token AND j.state || '' = 'running'
    FOR UPDATE OF j SKIP LOCKED
),
settling AS MATERIALIZED (
    -- Batches whose counts an ending member moves, locked without waiting.
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
    FOR NO KEY UPDATE OF b SKIP LOCKED
),
moved AS (
    -- A job that leaves: its row as the write below would have left it, into the history.
    DELETE FROM jobs_job j USING free f
    WHERE j.id = f.id AND f.leaves
    RETURNING j.id,
              f.state AS state,
              j.attempts + f.attempts_delta AS attempts,
              j.heartbeat_at,
              CASE WHEN f.stopped THEN 'cancelled' ELSE COALESCE(f.code, j.last_error) END AS last_error,
              CASE WHEN f.stopped THEN ('cancelled while running, asked by ' || j.cancel_requested_by) ELSE COALESCE(f.detail, j.error_detail) END AS error_detail,
              j.created_at,
              statement_timestamp() AS finished_at,
              j.job_id,
              j.name,
              j.payload,
              j.tenant,
              j.queue,
              j.priority,
              j.max_attempts,
              j.run_after,
              j.claimed_by,
              CASE WHEN f.attempts_delta < 0 THEN NULL ELSE j.started_at END AS started_at,
              j.keyed,
              f.result AS result,
              j.replayed_at,
              j.replayed_by,
              j.attempt_log,
              j.batch_id,
              COALESCE(f.report, j.progress) AS progress,
              f.token, f.stopped, f.attempts_delta
),
archived AS (
    INSERT INTO jobs_jobhistory (id, state, attempts, heartbeat_at, last_error, error_detail, created_at, finished_at, job_id, name, payload, tenant, queue, priority, max_attempts, run_after, claimed_by, started_at, keyed, result, replayed_at, replayed_by, attempt_log, batch_id, progress) SELECT id, state, attempts, heartbeat_at, last_error, error_detail, created_at, finished_at, job_id, name, payload, tenant, queue, priority, max_attempts, run_after, claimed_by, started_at, keyed, result, replayed_at, replayed_by, attempt_log, batch_id, progress FROM moved
),
unlinked AS (
    -- What a finished job waited for matters no more once it leaves (jobs.queue.dependencies).
    DELETE FROM jobs_dependency d WHERE d.job IN (SELECT m.id FROM moved m)
),
updated AS (
    UPDATE jobs_job j
    SET state = f.state,
        attempts = j.attempts + f.attempts_delta,
        run_after = CASE WHEN f.state = 'queued'
                         THEN COALESCE(f.at, statement_timestamp() + make_interval(secs => f.delay))
                         ELSE j.run_after END,
        finished_at = CASE WHEN f.state = 'queued' THEN NULL ELSE statement_timestamp() END,
        started_at = CASE WHEN f.attempts_delta < 0 THEN NULL ELSE j.started_at END,
        last_error = CASE WHEN f.stopped THEN 'cancelled' ELSE COALESCE(f.code, j.last_error) END,
        error_detail = CASE WHEN f.stopped THEN ('cancelled while running, asked by ' || j.cancel_requested_by) ELSE COALESCE(f.detail, j.error_detail) END,
        result = f.result,
        progress = COALESCE(f.report, j.progress),
        claim_token = NULL,
        lease_expires_at = NULL,
        -- Only a key the caller chose is held, while the job is active and through its
        -- window (a keyless row enqueued by an earlier release held its key while active).
        key_held = j.keyed,
        -- A finished job keeps the identity of the worker that finished it.
        claimed_by = CASE WHEN f.state = 'queued' THEN '' ELSE j.claimed_by END,
        -- Back in the queue in its type's order now: tenant order may have begun meanwhile.
        fair = CASE WHEN f.state = 'queued' THEN (j.name = ANY((SELECT COALESCE(array_agg(f.name::text), '{}') FROM jobs_flow f WHERE f.tenant_ordered)::text[])) ELSE j.fair END,
        -- An attempt that sends the job back to the queue goes to the log; one that ends
        -- the job stays in the columns (jobs.queue.attempts). A hand-back ran nothing.
        attempt_log = CASE WHEN f.state = 'queued' AND f.attempts_delta >= 0
            THEN j.attempt_log || jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
        'attempt', j.attempts, 'started_at', j.started_at,
        'ended_at', statement_timestamp(), 'worker', NULLIF(j.claimed_by, ''),
        'outcome', 'retry', 'code', NULLIF(f.code, ''),
        'error', NULLIF(right(f.detail, 2000), '')))) ELSE j.attempt_log END
    FROM free f
    WHERE j.id = f.id AND NOT f.leaves
      AND (f.batch_id IS NULL OR f.state = 'queued' OR f.batch_id IN (SELECT id FROM settling))
    RETURNING j.id, f.token, CASE WHEN f.stopped THEN j.error_detail END AS stopped,
              j.depended_on AND f.state <> 'queued' AS settles,
              j.name AS wname, j.tenant AS wtenant
),
written AS (
    SELECT id, token, stopped, settles, wname, wtenant FROM updated
    UNION ALL
    SELECT id, token, CASE WHEN stopped THEN error_detail END, FALSE, name, tenant
    FROM moved
),
-- Held under their token but not written: another session holds the row locked. Looked
-- for only when some outcome was not written: comparing each outcome with every written one
-- costs the square of the batch.
busy AS (
    SELECT o.id, o.token FROM o
    WHERE (SELECT count(*) FROM written) < (SELECT count(*) FROM o)
      AND NOT EXISTS (SELECT 1 FROM written w WHERE w.token = o.token)
      AND EXISTS (
          SELECT 1 FROM jobs_job j
          WHERE j.id = o.id AND j.claim_token = o.token AND j.state || '' = 'running'
      )
)
,
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
                     LIMIT w.gcap + (SELECT count(*) FROM written wr WHERE wr.wname = w.name)) running)::int + (SELECT count(*) FROM written wr WHERE wr.wname = w.name)::int END,
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
SELECT *, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy), (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL), (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL), (SELECT bool_or(settles) FROM written)
;
