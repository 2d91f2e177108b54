-- As the enqueue commits: mark each job waited for, under its row lock (held from here to the
-- commit, not for the producer's whole transaction), and apply its outcome if it ended after
-- the enqueue read it: its release ran without these edges, which were not committed yet.
-- The first check of a transaction does all of its rows (no other transaction's are
-- visible), in the order of the jobs waited for: two producers locking them in opposite
-- orders could deadlock. The checks after it find their rows gone.
CREATE OR REPLACE FUNCTION jobs_dependency_checked() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    c record;
    s text;
    marked boolean;
BEGIN
    FOR c IN
        SELECT upstream, array_agg(j ORDER BY j) AS jobs
        FROM jobs_dependency_check, unnest(jobs) AS j
        GROUP BY upstream ORDER BY upstream
    LOOP
        SELECT state, depended_on INTO s, marked FROM jobs_job
        WHERE id = c.upstream FOR NO KEY UPDATE;
        IF NOT FOUND THEN
            SELECT state INTO s FROM jobs_jobhistory WHERE id = c.upstream;
            s := COALESCE(s, 'cancelled');  -- gone from both tables: it cannot succeed now
        ELSIF NOT marked THEN
            UPDATE jobs_job SET depended_on = TRUE WHERE id = c.upstream;
        END IF;
        IF s IN ('succeeded', 'failed', 'cancelled') THEN
            PERFORM jobs_dependents_release(c.upstream, s, c.jobs);
        END IF;
    END LOOP;
    DELETE FROM jobs_dependency_check;
    RETURN NULL;
END
$$;

-- At the enqueue's commit, once per row of jobs_dependency_check (the first call does them
-- all). A constraint trigger cannot be replaced in place: installed again, it is made anew.
DROP TRIGGER IF EXISTS jobs_dependency_checked ON jobs_dependency_check;
CREATE CONSTRAINT TRIGGER jobs_dependency_checked
AFTER INSERT ON jobs_dependency_check
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION jobs_dependency_checked();
