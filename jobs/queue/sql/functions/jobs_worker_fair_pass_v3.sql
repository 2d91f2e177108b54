-- Rendered from jobs/queue/cycle.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).
CREATE OR REPLACE FUNCTION jobs_worker_fair_pass_v3(
    p_ids bigint[],
    p_tokens uuid[],
    p_states text[],
    p_codes text[],
    p_details text[],
    p_delays float8[],
    p_ats timestamptz[],
    p_deltas integer[],
    p_results jsonb[],
    p_reports jsonb[],
    p_names text[],
    p_limits integer[],
    p_caps integer[],
    p_gcaps integer[],
    p_tcaps integer[],
    p_rates float8[],
    p_bursts float8[],
    p_trates float8[],
    p_tbursts float8[],
    p_gated boolean[],
    p_ordered boolean[],
    p_afters text[],
    p_lshares float8[],
    p_total integer,
    p_lease float8,
    p_worker text,
    p_tenant text,
    p_component text
) RETURNS TABLE (r_id bigint, r_job_id text, r_name text, r_payload jsonb, r_tenant text, r_queue text, r_priority integer, r_attempts integer, r_max_attempts integer, r_claim_token uuid, r_latency float8, r_ord bigint, r_due float8, r_written uuid[], r_busy uuid[], r_stopped uuid[], r_details text[], r_settle boolean)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY
        WITH
        o AS (
            -- Of two outcomes for one attempt, the later.
            SELECT DISTINCT ON (o.id, o.token) * FROM unnest(
                p_ids::bigint[], p_tokens::uuid[], p_states::text[], p_codes::text[],
                p_details::text[], p_delays::float8[], p_ats::timestamptz[], p_deltas::int[],
                p_results::jsonb[], p_reports::jsonb[]
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
                p_names::text[], p_limits::int[], p_caps::int[], p_gcaps::int[],
                p_tcaps::int[], p_rates::float8[], p_bursts::float8[], p_trates::float8[],
                p_tbursts::float8[], p_gated::bool[], p_ordered::bool[], p_afters::text[],
                p_lshares::float8[]
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
                p_tenant::text, p_component::text) AS f(id, tenant, base, top)
            WHERE w.lim > 0 AND w.ordered AND w.tcap IS NULL AND w.trate IS NULL
        ),
        picked AS (
            SELECT c.id, w.cap, w.ord
            FROM room w
            CROSS JOIN LATERAL (
                SELECT fp.id FROM fair_pick fp WHERE fp.name = w.name AND fp.id IS NOT NULL
            ) c
            WHERE w.lim > 0
            LIMIT p_total
        )
        , claimed(c_id, c_job_id, c_name, c_payload, c_tenant, c_queue, c_priority, c_attempts, c_max_attempts, c_claim_token, c_latency, c_ord, c_due) AS (
        UPDATE jobs_job j
        SET state = 'running',
            attempts = j.attempts + 1,
            claim_token = gen_random_uuid(),
            lease_expires_at = statement_timestamp() + make_interval(secs => p_lease),
            heartbeat_at = statement_timestamp(),
            started_at = statement_timestamp(),
            claimed_by = p_worker
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
                    SELECT c.c_name AS name, c.c_tenant AS tenant, c.c_priority AS priority,
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
        SELECT c_id::bigint, c_job_id::text, c_name::text, c_payload::jsonb, c_tenant::text, c_queue::text, c_priority::integer, c_attempts::integer, c_max_attempts::integer, c_claim_token::uuid, c_latency::float8, c_ord::bigint, c_due::float8, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean FROM claimed
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy), (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL), (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL), (SELECT bool_or(settles) FROM written);
END
$$;
