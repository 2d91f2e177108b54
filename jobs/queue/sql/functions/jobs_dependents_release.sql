-- Applies an ended job's outcome to the waiting jobs p_jobs whose edge to it is not settled
-- yet (each edge once, whoever comes first): on success each has one fewer to wait for and is
-- due now when none is left; on failure or cancellation each ends as its edge says. Returns
-- how many waiting jobs changed.
CREATE OR REPLACE FUNCTION jobs_dependents_release(p_upstream bigint, p_state text, p_jobs bigint[])
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    n integer;
    due text[];
BEGIN
    IF p_state = 'succeeded' THEN
        WITH edges AS (
            UPDATE jobs_dependency d SET settled = TRUE
            WHERE d.upstream = p_upstream AND d.job = ANY(p_jobs) AND NOT d.settled
            RETURNING d.job
        ),
        released AS (
            UPDATE jobs_job j
            SET waiting_on = j.waiting_on - 1,
                run_after = CASE WHEN j.waiting_on = 1 THEN statement_timestamp()
                                 ELSE j.run_after END
            FROM edges e
            WHERE j.id = e.job AND j.state || '' = 'queued' AND j.waiting_on > 0
            RETURNING j.name, j.waiting_on
        )
        SELECT count(*), array_agg(DISTINCT name) FILTER (WHERE waiting_on = 0)
        INTO n, due FROM released;
        PERFORM pg_notify('jobs_enqueued', x) FROM unnest(due) AS x;
    ELSE
        -- Ending them moves their batches' counts: those rows first, in id order, as
        -- everything that ends a batch member locks them (jobs.queue.batches.lock_for).
        PERFORM 1 FROM jobs_batch b
        WHERE b.id IN (SELECT COALESCE(j.batch_id, 0) FROM jobs_job j WHERE j.id = ANY(p_jobs))
        ORDER BY b.id FOR NO KEY UPDATE;
        WITH edges AS (
            UPDATE jobs_dependency d SET settled = TRUE
            WHERE d.upstream = p_upstream AND d.job = ANY(p_jobs) AND NOT d.settled
            RETURNING d.job, d.on_failure
        ),
        ended AS (
            UPDATE jobs_job j
            SET state = CASE WHEN e.on_failure = 'fail' THEN 'failed' ELSE 'cancelled' END,
                -- A cancelled job lets its job_id go at once, a failed one keeps it through
                -- its window (as operator cancels and failures do).
                key_held = j.keyed AND e.on_failure = 'fail',
                waiting_on = 0,
                run_after = statement_timestamp(),
                finished_at = statement_timestamp(),
                last_error = 'dependency_failed',
                error_detail = format('job %s, which this job waited for, ended %s', p_upstream,
                                      p_state)
            FROM edges e
            WHERE j.id = e.job AND j.state || '' = 'queued' AND j.waiting_on > 0
            RETURNING j.id
        )
        SELECT count(*) INTO n FROM ended;
    END IF;
    RETURN n;
END
$$;
