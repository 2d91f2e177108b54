-- Rendered from jobs/queue/enqueue_one.py by scripts/render-sql:
-- edit the code, not this file, then run it (a test fails while the two differ).
CREATE OR REPLACE FUNCTION jobs_enqueue_job(
    p_job_id text,
    p_name text,
    p_payload jsonb,
    p_tenant text,
    p_queue text,
    p_priority integer,
    p_max_attempts integer,
    p_run_after timestamptz,
    p_delay float8,
    p_keyed boolean,
    p_batch_id bigint,
    p_waiting_on integer,
    p_channel text
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
    v_at timestamptz := statement_timestamp();
    v_run_after timestamptz := COALESCE(p_run_after, v_at + make_interval(secs => p_delay));
BEGIN
    IF p_keyed THEN
        INSERT INTO jobs_job (
            job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
            state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
            replayed_by, created_at, fair, batch_id, waiting_on
        )
        VALUES (
            p_job_id, p_name, p_payload, p_tenant, p_queue, p_priority, p_max_attempts,
            v_run_after, 'queued', 0, '', '', '', p_keyed, p_keyed, '', v_at,
            EXISTS (SELECT FROM jobs_flow f WHERE f.name = p_name AND f.tenant_ordered),
            p_batch_id, p_waiting_on
        )
        ON CONFLICT (tenant, job_id) WHERE key_held DO NOTHING
        RETURNING id INTO v_id;
    ELSE
        INSERT INTO jobs_job (
            job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
            state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
            replayed_by, created_at, fair, batch_id, waiting_on
        )
        VALUES (
            p_job_id, p_name, p_payload, p_tenant, p_queue, p_priority, p_max_attempts,
            v_run_after, 'queued', 0, '', '', '', p_keyed, p_keyed, '', v_at,
            EXISTS (SELECT FROM jobs_flow f WHERE f.name = p_name AND f.tenant_ordered),
            p_batch_id, p_waiting_on
        )
        RETURNING id INTO v_id;
    END IF;
    IF v_id IS NOT NULL AND p_channel IS NOT NULL AND v_run_after <= v_at THEN
        PERFORM pg_notify(p_channel, p_name);
    END IF;
    RETURN v_id;
END
$$;
