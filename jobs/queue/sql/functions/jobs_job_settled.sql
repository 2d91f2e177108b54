-- A job others wait for has ended (or left a terminal state, for its batch): its batch's
-- counts move now, and its waiting jobs are released after this transaction
-- (jobs.queue.dependencies.release), so this costs the same whatever their number.
CREATE OR REPLACE FUNCTION jobs_job_settled() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.batch_id IS NOT NULL THEN
        PERFORM jobs_batch_settle(
            NEW.batch_id,
            (NEW.state = 'succeeded')::integer - (OLD.state = 'succeeded')::integer,
            (NEW.state = 'failed')::integer - (OLD.state = 'failed')::integer,
            (NEW.state = 'cancelled')::integer - (OLD.state = 'cancelled')::integer
        );
    END IF;
    IF NEW.depended_on AND NEW.state IN ('succeeded', 'failed', 'cancelled') THEN
        INSERT INTO jobs_settlement (upstream, state) VALUES (NEW.id, NEW.state);
    END IF;
    RETURN NULL;
END
$$;

-- Only a change into or out of a terminal state of a member or of a job others wait for
-- calls the function; claims, renewals and every other job pay for the WHEN test alone.
CREATE OR REPLACE TRIGGER jobs_job_settled
AFTER UPDATE OF state ON jobs_job
FOR EACH ROW
WHEN (
    OLD.state IS DISTINCT FROM NEW.state
    AND (OLD.state IN ('succeeded', 'failed', 'cancelled')
         OR NEW.state IN ('succeeded', 'failed', 'cancelled'))
    AND (NEW.batch_id IS NOT NULL OR NEW.depended_on)
)
EXECUTE FUNCTION jobs_job_settled();
