"""The settle trigger's dependents function finds the waiting jobs by key (same schema).

``jobs_dependents_settle`` (0013) looked the jobs waiting for a finished one up by id with
``state = 'queued'``, which the claim index's predicate matches. A plpgsql function keeps a
plan for its connection's life; made when few jobs were queued (statistics taken on a quiet
queue), that plan read the claim index whole, every queued job, on each success or failure
of a job others wait for: 30,000 rows for one dependent. ``state || ''`` tests the same and
matches no index's predicate, so the rows are read by key.

Going back puts 0013's definition back.
"""

from django.db import migrations

SQL = r"""
-- A job others wait for has finished: on success each waiting job has one fewer to wait for
-- (and is due now when none is left); on failure or cancellation every job waiting down the
-- chain ends, each as the edge it waited by says, in one statement. Their own state changes
-- fire the trigger again, which finds nothing left to end below them: the nesting is two
-- calls deep, however long the chain.
CREATE OR REPLACE FUNCTION jobs_dependents_settle(p_upstream bigint, p_state text)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    due text[];
BEGIN
    IF p_state = 'succeeded' THEN
        WITH released AS (
            UPDATE jobs_job j
            SET waiting_on = j.waiting_on - 1,
                run_after = CASE WHEN j.waiting_on = 1 THEN statement_timestamp()
                                 ELSE j.run_after END
            FROM jobs_dependency d
            WHERE d.upstream = p_upstream AND j.id = d.job
              AND j.state || '' = 'queued' AND j.waiting_on > 0
            RETURNING j.name, j.waiting_on
        )
        SELECT array_agg(DISTINCT name) FILTER (WHERE waiting_on = 0) INTO due
        FROM released;
        PERFORM pg_notify('jobs_enqueued', n) FROM unnest(due) AS n;
    ELSIF p_state IN ('failed', 'cancelled') THEN
        WITH RECURSIVE doomed (job, upstream, upstream_state, ends) AS (
            SELECT d.job, d.upstream, p_state,
                   CASE WHEN d.on_failure = 'fail' THEN 'failed' ELSE 'cancelled' END
            FROM jobs_dependency d
            JOIN jobs_job j ON j.id = d.job AND j.state || '' = 'queued' AND j.waiting_on > 0
            WHERE d.upstream = p_upstream
          UNION
            SELECT d.job, d.upstream, doomed.ends,
                   CASE WHEN d.on_failure = 'fail' THEN 'failed' ELSE 'cancelled' END
            FROM doomed
            JOIN jobs_dependency d ON d.upstream = doomed.job
            JOIN jobs_job j ON j.id = d.job AND j.state || '' = 'queued' AND j.waiting_on > 0
        ),
        -- A job reached along several paths ends once, by the lowest upstream's edge.
        ending AS (
            SELECT DISTINCT ON (job) job, upstream, upstream_state, ends
            FROM doomed ORDER BY job, upstream
        )
        UPDATE jobs_job j
        SET state = e.ends,
            -- A cancelled job lets its job_id go at once, a failed one keeps it through
            -- its window (as operator cancels and failures do).
            key_held = e.ends = 'failed',
            waiting_on = 0,
            run_after = statement_timestamp(),
            finished_at = statement_timestamp(),
            last_error = 'dependency_failed',
            error_detail = format('job %s, which this job waited for, ended %s', e.upstream,
                                  e.upstream_state)
        FROM ending e
        WHERE j.id = e.job AND j.state || '' = 'queued' AND j.waiting_on > 0;
    END IF;
END
$$;
"""

REVERSE_SQL = SQL.replace("j.state || '' = 'queued'", "j.state = 'queued'")


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0023_worker_fair_pass_linear"),
    ]

    operations = [migrations.RunSQL(SQL, reverse_sql=REVERSE_SQL)]
