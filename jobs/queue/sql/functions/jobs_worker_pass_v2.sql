-- The pass of the previous release, kept as it installed it: its workers call it during a
-- rolling deploy, and after going back past the migration that installs the next one. Not
-- rendered and never changed; a later migration drops it.
CREATE OR REPLACE FUNCTION jobs_worker_pass_v2(
    p_walk boolean,
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
    p_total integer,
    p_lease float8,
    p_worker text,
    p_tenant text,
    p_component text
) RETURNS TABLE (r_id bigint, r_job_id text, r_name text, r_payload jsonb, r_tenant text, r_queue text, r_priority integer, r_attempts integer, r_max_attempts integer, r_claim_token uuid, r_latency float8, r_ord bigint, r_due float8, r_written uuid[], r_busy uuid[], r_stopped uuid[], r_details text[], r_settle boolean)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    IF p_walk THEN
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
                   o.report, j.batch_id,
                   CASE WHEN j.cancel_requested_at IS NOT NULL AND o.state = 'queued'
                        THEN 'cancelled' ELSE o.state END AS state,
                   j.cancel_requested_at IS NOT NULL
                       AND (o.state IN ('queued', 'cancelled')) AS stopped
            FROM jobs_job j JOIN o ON j.id = o.id
            WHERE j.claim_token = o.token AND j.state || '' = 'running'
            FOR UPDATE OF j SKIP LOCKED
        ),
        settling AS MATERIALIZED (
            -- Batches whose counts an ending member moves, locked without waiting.
            SELECT b.id FROM jobs_batch b
            WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
            FOR NO KEY UPDATE OF b SKIP LOCKED
        ),
        written AS (
            UPDATE jobs_job j
            SET state = f.state,
                attempts = j.attempts + f.attempts_delta,
                run_after = CASE WHEN f.state = 'queued'
                                 THEN COALESCE(f.at, statement_timestamp() + make_interval(secs => f.delay))
                                 ELSE j.run_after END,
                finished_at = CASE WHEN f.state = 'queued' THEN NULL ELSE statement_timestamp() END,
                -- A hand-back ran nothing: its claim is no attempt's start (jobs.queue.attempts).
                started_at = CASE WHEN f.attempts_delta < 0 THEN NULL ELSE j.started_at END,
                last_error = CASE WHEN f.stopped THEN 'cancelled' ELSE COALESCE(f.code, j.last_error) END,
                error_detail = CASE WHEN f.stopped THEN ('cancelled while running, asked by ' || j.cancel_requested_by) ELSE COALESCE(f.detail, j.error_detail) END,
                result = f.result,
                -- The handler's last progress report, if the lease renewals had not written it.
                progress = COALESCE(f.report, j.progress),
                claim_token = NULL,
                lease_expires_at = NULL,
                -- A generated job_id is never submitted again: a finished keyless job lets it go.
                key_held = (f.state = 'queued' OR j.keyed),
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
            WHERE j.id = f.id
              AND (f.batch_id IS NULL OR f.state = 'queued' OR f.batch_id IN (SELECT id FROM settling))
            RETURNING j.id, f.token, CASE WHEN f.stopped THEN j.error_detail END AS stopped,
                      j.depended_on AND f.state <> 'queued' AS settles,
                      j.name AS wname, j.tenant AS wtenant
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
            SELECT * FROM unnest(p_names::text[], p_limits::int[], p_caps::int[])
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
          AND (p_tenant IS NULL OR j.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = p_component))
          AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
        ORDER BY j.priority DESC, j.run_after, j.id
        LIMIT w.lim
        FOR UPDATE SKIP LOCKED
        ) due
        LIMIT w.lim

            ) c
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
        )
        SELECT c_id::bigint, c_job_id::text, c_name::text, c_payload::jsonb, c_tenant::text, c_queue::text, c_priority::integer, c_attempts::integer, c_max_attempts::integer, c_claim_token::uuid, c_latency::float8, c_ord::bigint, c_due::float8, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean FROM claimed
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy), (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL), (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL), (SELECT bool_or(settles) FROM written);
    ELSE
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
                   o.report, j.batch_id,
                   CASE WHEN j.cancel_requested_at IS NOT NULL AND o.state = 'queued'
                        THEN 'cancelled' ELSE o.state END AS state,
                   j.cancel_requested_at IS NOT NULL
                       AND (o.state IN ('queued', 'cancelled')) AS stopped
            FROM jobs_job j JOIN o ON j.id = o.id
            WHERE j.claim_token = o.token AND j.state || '' = 'running'
            FOR UPDATE OF j SKIP LOCKED
        ),
        settling AS MATERIALIZED (
            -- Batches whose counts an ending member moves, locked without waiting.
            SELECT b.id FROM jobs_batch b
            WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
            FOR NO KEY UPDATE OF b SKIP LOCKED
        ),
        written AS (
            UPDATE jobs_job j
            SET state = f.state,
                attempts = j.attempts + f.attempts_delta,
                run_after = CASE WHEN f.state = 'queued'
                                 THEN COALESCE(f.at, statement_timestamp() + make_interval(secs => f.delay))
                                 ELSE j.run_after END,
                finished_at = CASE WHEN f.state = 'queued' THEN NULL ELSE statement_timestamp() END,
                -- A hand-back ran nothing: its claim is no attempt's start (jobs.queue.attempts).
                started_at = CASE WHEN f.attempts_delta < 0 THEN NULL ELSE j.started_at END,
                last_error = CASE WHEN f.stopped THEN 'cancelled' ELSE COALESCE(f.code, j.last_error) END,
                error_detail = CASE WHEN f.stopped THEN ('cancelled while running, asked by ' || j.cancel_requested_by) ELSE COALESCE(f.detail, j.error_detail) END,
                result = f.result,
                -- The handler's last progress report, if the lease renewals had not written it.
                progress = COALESCE(f.report, j.progress),
                claim_token = NULL,
                lease_expires_at = NULL,
                -- A generated job_id is never submitted again: a finished keyless job lets it go.
                key_held = (f.state = 'queued' OR j.keyed),
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
            WHERE j.id = f.id
              AND (f.batch_id IS NULL OR f.state = 'queued' OR f.batch_id IN (SELECT id FROM settling))
            RETURNING j.id, f.token, CASE WHEN f.stopped THEN j.error_detail END AS stopped,
                      j.depended_on AND f.state <> 'queued' AS settles,
                      j.name AS wname, j.tenant AS wtenant
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
            SELECT * FROM unnest(p_names::text[], p_limits::int[], p_caps::int[])
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
          AND (p_tenant IS NULL OR j.tenant = p_tenant) AND (p_component IS NULL OR NOT EXISTS (SELECT 1 FROM jobs_tenantoverride o WHERE o.tenant = j.tenant AND o.component = p_component))
          AND NOT (j.queue || '' = ANY((SELECT queues FROM paused)::text[])) AND NOT (j.tenant || '' = ANY((SELECT tenants FROM paused)::text[]))
        ORDER BY j.priority DESC, j.run_after, j.id
        LIMIT w.lim
        FOR UPDATE SKIP LOCKED

            ) c
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
        )
        SELECT c_id::bigint, c_job_id::text, c_name::text, c_payload::jsonb, c_tenant::text, c_queue::text, c_priority::integer, c_attempts::integer, c_max_attempts::integer, c_claim_token::uuid, c_latency::float8, c_ord::bigint, c_due::float8, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean FROM claimed
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy), (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL), (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL), (SELECT bool_or(settles) FROM written);
    END IF;
END
$$;
