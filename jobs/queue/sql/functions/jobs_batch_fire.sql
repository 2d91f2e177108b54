-- Marks the batch finished and enqueues its successor, once: the fired_at guard under the
-- row lock makes every later call a no-op. The successor is the row the batch was opened
-- with, due now. A job holding the successor's job_id whose window has passed lets the key
-- go first, as enqueue does (the windows come with the successor's template).
CREATE OR REPLACE FUNCTION jobs_batch_fire(p_batch bigint) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    s jsonb;
    new_id bigint;
BEGIN
    UPDATE jobs_batch SET fired_at = statement_timestamp()
    WHERE id = p_batch AND fired_at IS NULL
    RETURNING successor INTO s;
    IF NOT FOUND OR s IS NULL THEN
        RETURN;
    END IF;
    IF s ? 'success_window' THEN
        UPDATE jobs_job j SET key_held = FALSE
        WHERE j.tenant = s->>'tenant' AND j.job_id = s->>'job_id' AND j.key_held
          AND ((j.state = 'succeeded' AND j.finished_at <= statement_timestamp()
                    - make_interval(secs => (s->>'success_window')::float8))
               OR (j.state IN ('failed', 'cancelled') AND j.finished_at <= statement_timestamp()
                    - make_interval(secs => (s->>'failure_window')::float8)));
    END IF;
    INSERT INTO jobs_job (
        job_id, name, payload, tenant, queue, priority, max_attempts, run_after, state,
        attempts, last_error, error_detail, claimed_by, key_held, keyed, replayed_by,
        created_at, fair
    )
    VALUES (
        s->>'job_id', s->>'name', s->'payload', s->>'tenant', s->>'queue',
        (s->>'priority')::smallint, (s->>'max_attempts')::integer, statement_timestamp(),
        'queued', 0, '', '', '', (s->>'keyed')::boolean, (s->>'keyed')::boolean, '',
        statement_timestamp(),
        COALESCE((SELECT f.tenant_ordered FROM jobs_flow f WHERE f.name = s->>'name'), FALSE)
    )
    ON CONFLICT (tenant, job_id) WHERE key_held DO NOTHING
    RETURNING id INTO new_id;
    IF new_id IS NULL THEN
        -- A caller-given successor job_id held by a job within its window: that job is the
        -- successor.
        SELECT id INTO new_id FROM jobs_job
        WHERE tenant = s->>'tenant' AND job_id = s->>'job_id' AND key_held;
    ELSE
        PERFORM pg_notify('jobs_enqueued', s->>'name');
    END IF;
    UPDATE jobs_batch SET successor_pk = new_id WHERE id = p_batch;
END
$$;
