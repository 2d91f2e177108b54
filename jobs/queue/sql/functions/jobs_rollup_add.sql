-- The console's history: attempts ended, added to this minute's rollup rows (per type,
-- outcome, error code and backend, so concurrent writers do not queue on one row). Called
-- by the CTE of jobs.queue.rollup.cte in the statements that end attempts.
--
-- A PL/pgSQL function so that its plans are cached per connection: inlined into every
-- outcome write (never a prepared statement), the upsert was planned with each one (0.6 ms a
-- statement), and its histogram subqueries cost as much again to execute. The histograms are
-- built and added with loops instead. Nothing here is session state a pooler could lose.
-- The bucket bounds are jobs.queue.rollup.BOUNDS (a test checks that the two agree).
CREATE OR REPLACE FUNCTION jobs_rollup_add(
    names text[], outcomes text[], codes text[], ran float8[], waited float8[]
) RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    added integer;
BEGIN
    INSERT INTO jobs_rollup AS r (
        period, width, name, outcome, code, shard, count, run_seconds, wait_seconds,
        run_histogram, wait_histogram
    )
    SELECT date_trunc('minute', statement_timestamp(), 'UTC'), 60, g.name, g.outcome, g.code,
           pg_backend_pid(), g.n, g.ran, g.waited,
           jobs_histogram_of(g.ran_buckets), jobs_histogram_of(g.wait_buckets)
    FROM (
        SELECT e.name, e.outcome, left(COALESCE(e.code, ''), 32) AS code, count(*) AS n,
               COALESCE(sum(e.ran), 0) AS ran, COALESCE(sum(e.waited), 0) AS waited,
               array_agg(width_bucket(e.ran, '{0.001,0.0014142135623730952,0.002,0.0028284271247461905,0.004,0.005656854249492381,0.008,0.011313708498984762,0.016,0.022627416997969524,0.032,0.04525483399593905,0.064,0.0905096679918781,0.128,0.1810193359837562,0.256,0.3620386719675124,0.512,0.7240773439350248,1.024,1.4481546878700495,2.048,2.896309375740099,4.096,5.792618751480198,8.192,11.585237502960396,16.384,23.170475005920792,32.768,46.340950011841585,65.536,92.68190002368317,131.072,185.36380004736634,262.144,370.7276000947327,524.288,741.4552001894654,1048.576,1482.9104003789307,2097.152,2965.8208007578614,4194.304,5931.641601515723,8388.608,11863.283203031446,16777.216,23726.56640606289,33554.432,47453.13281212578,67108.864,94906.26562425157,134217.728,189812.53124850313}'::float8[])) AS ran_buckets,
               array_agg(width_bucket(e.waited, '{0.001,0.0014142135623730952,0.002,0.0028284271247461905,0.004,0.005656854249492381,0.008,0.011313708498984762,0.016,0.022627416997969524,0.032,0.04525483399593905,0.064,0.0905096679918781,0.128,0.1810193359837562,0.256,0.3620386719675124,0.512,0.7240773439350248,1.024,1.4481546878700495,2.048,2.896309375740099,4.096,5.792618751480198,8.192,11.585237502960396,16.384,23.170475005920792,32.768,46.340950011841585,65.536,92.68190002368317,131.072,185.36380004736634,262.144,370.7276000947327,524.288,741.4552001894654,1048.576,1482.9104003789307,2097.152,2965.8208007578614,4194.304,5931.641601515723,8388.608,11863.283203031446,16777.216,23726.56640606289,33554.432,47453.13281212578,67108.864,94906.26562425157,134217.728,189812.53124850313}'::float8[])) AS wait_buckets
        FROM unnest(names, outcomes, codes, ran, waited) AS e(name, outcome, code, ran, waited)
        GROUP BY 1, 2, 3
    ) AS g
    ON CONFLICT (period, width, name, outcome, code, shard) DO UPDATE SET
        count = r.count + EXCLUDED.count,
        run_seconds = r.run_seconds + EXCLUDED.run_seconds,
        wait_seconds = r.wait_seconds + EXCLUDED.wait_seconds,
        run_histogram = jobs_histogram_add(r.run_histogram, EXCLUDED.run_histogram),
        wait_histogram = jobs_histogram_add(r.wait_histogram, EXCLUDED.wait_histogram);
    GET DIAGNOSTICS added = ROW_COUNT;
    RETURN added;
EXCEPTION WHEN OTHERS THEN
    -- The history is not worth a job: a rollup that cannot be written (a role without the
    -- grant, a full disk of a tablespace) costs its counts, never the outcome write around it.
    RAISE WARNING 'jobs_rollup_add: the console history was not written: % (%)',
        SQLERRM, SQLSTATE;
    RETURN 0;
END
$$;
