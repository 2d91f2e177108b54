-- A batch's counts move by the deltas of one member's state change; the change that settles
-- the last member of a sealed batch fires its successor.
CREATE OR REPLACE FUNCTION jobs_batch_settle(
    p_batch bigint, p_succeeded integer, p_failed integer, p_cancelled integer
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    b jobs_batch%ROWTYPE;
BEGIN
    -- The row lock taken here is held to the end of the transaction: concurrent members
    -- settle one after another, each seeing the counts the one before it committed.
    UPDATE jobs_batch
    SET succeeded = succeeded + p_succeeded,
        failed = failed + p_failed,
        cancelled = cancelled + p_cancelled
    WHERE id = p_batch
    RETURNING * INTO b;
    IF FOUND AND b.sealed_at IS NOT NULL AND b.fired_at IS NULL
       AND b.succeeded + b.failed + b.cancelled >= b.total THEN
        PERFORM jobs_batch_fire(p_batch);
    END IF;
END
$$;
