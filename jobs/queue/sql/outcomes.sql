-- Rendered from jobs/queue/outcomes.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).

-- name: record
-- Outcomes written, fenced by their claim tokens, and counted in the console's
-- rollup; an ending batch member waits for its batch's row (locked first).
WITH
batches_first AS MATERIALIZED (
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT COALESCE(j.batch_id, 0) FROM jobs_job j
                   WHERE j.id = ANY(%(ids)b::bigint[]))
    ORDER BY b.id
    FOR NO KEY UPDATE OF b
),
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
               AND (o.state IN ('queued', 'cancelled')) AS stopped, l.leaves,
           GREATEST(0, EXTRACT(EPOCH FROM statement_timestamp() - j.started_at))::float8 AS ran,
           GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8 AS waited
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
      AND (SELECT count(*) FROM batches_first) >= 0
    FOR UPDATE OF j SKIP LOCKED
),
settling AS MATERIALIZED (
    -- Batches whose counts an ending member moves, locked without waiting.
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
    FOR NO KEY UPDATE OF b
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
              f.token, f.stopped, f.attempts_delta, f.ran, f.waited
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
              j.name AS wname, j.tenant AS wtenant,
              j.name, f.state, j.last_error AS code, f.attempts_delta >= 0 AS ran_attempt,
              CASE WHEN f.attempts_delta >= 0 THEN f.ran END AS ran, f.waited
),
written AS (
    SELECT id, token, stopped, settles, wname, wtenant, name, state, code, ran_attempt, ran, waited FROM updated
    UNION ALL
    SELECT id, token, CASE WHEN stopped THEN error_detail END, FALSE, name, tenant, name, state, last_error, attempts_delta >= 0,
           CASE WHEN attempts_delta >= 0 THEN ran END, waited
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
rolled AS (
    SELECT jobs_rollup_add(array_agg(e.name), array_agg(e.outcome), array_agg(e.code),
                           array_agg(e.ran), array_agg(e.waited)) AS added
    FROM (
    SELECT name, CASE state WHEN 'queued' THEN 'retried' ELSE state END,
           CASE WHEN state = 'succeeded' THEN '' ELSE code END, ran, waited
    FROM written WHERE ran_attempt OR state <> 'queued') AS e(name, outcome, code, ran, waited)
    HAVING count(*) > 0
) SELECT token, TRUE, stopped, settles FROM written WHERE (SELECT count(*) FROM rolled) >= 0 UNION ALL SELECT token, FALSE, NULL, FALSE FROM busy
;

-- name: record_uncounted
-- The same for a caller that counts its own attempts (the worker).
WITH
batches_first AS MATERIALIZED (
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT COALESCE(j.batch_id, 0) FROM jobs_job j
                   WHERE j.id = ANY(%(ids)b::bigint[]))
    ORDER BY b.id
    FOR NO KEY UPDATE OF b
),
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
      AND (SELECT count(*) FROM batches_first) >= 0
    FOR UPDATE OF j SKIP LOCKED
),
settling AS MATERIALIZED (
    -- Batches whose counts an ending member moves, locked without waiting.
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
    FOR NO KEY UPDATE OF b
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
 SELECT token, TRUE, stopped, settles FROM written UNION ALL SELECT token, FALSE, NULL, FALSE FROM busy
;

-- name: record_skipping
-- Never waiting: rows (and batch rows) another session holds are reported busy.
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
               AND (o.state IN ('queued', 'cancelled')) AS stopped, l.leaves,
           GREATEST(0, EXTRACT(EPOCH FROM statement_timestamp() - j.started_at))::float8 AS ran,
           GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8 AS waited
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
              f.token, f.stopped, f.attempts_delta, f.ran, f.waited
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
              j.name AS wname, j.tenant AS wtenant,
              j.name, f.state, j.last_error AS code, f.attempts_delta >= 0 AS ran_attempt,
              CASE WHEN f.attempts_delta >= 0 THEN f.ran END AS ran, f.waited
),
written AS (
    SELECT id, token, stopped, settles, wname, wtenant, name, state, code, ran_attempt, ran, waited FROM updated
    UNION ALL
    SELECT id, token, CASE WHEN stopped THEN error_detail END, FALSE, name, tenant, name, state, last_error, attempts_delta >= 0,
           CASE WHEN attempts_delta >= 0 THEN ran END, waited
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
rolled AS (
    SELECT jobs_rollup_add(array_agg(e.name), array_agg(e.outcome), array_agg(e.code),
                           array_agg(e.ran), array_agg(e.waited)) AS added
    FROM (
    SELECT name, CASE state WHEN 'queued' THEN 'retried' ELSE state END,
           CASE WHEN state = 'succeeded' THEN '' ELSE code END, ran, waited
    FROM written WHERE ran_attempt OR state <> 'queued') AS e(name, outcome, code, ran, waited)
    HAVING count(*) > 0
) SELECT token, TRUE, stopped, settles FROM written WHERE (SELECT count(*) FROM rolled) >= 0 UNION ALL SELECT token, FALSE, NULL, FALSE FROM busy
;

-- name: record_skipping_uncounted
-- The worker's outcome write when its pass claims nothing.
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
 SELECT token, TRUE, stopped, settles FROM written UNION ALL SELECT token, FALSE, NULL, FALSE FROM busy
;
