"""The settle trigger's functions, mended (same schema; 0010 made them).

* ``jobs_dependents_settle``: a job that failed or was cancelled ends every job waiting down
  its chain in one statement. 0010 ended the direct dependents, whose own state change fired
  the trigger again, one nested trigger call per link: a chain of a few hundred jobs
  exhausted PostgreSQL's stack, so the head's failure could not be written at all (and a
  sweep that failed it with others failed for every row).
* ``jobs_batch_fire``: a job holding the successor's ``job_id`` whose window has passed lets
  the key go first, as enqueue does, so a batch fired weeks after an earlier one with the
  same successor key gets a successor of its own instead of the old one's id. The windows
  come with the successor's template (batches opened before this migration have none, and
  keep the old behaviour).

Going back leaves these definitions in place: they work on 0012's schema.
"""

from django.db import migrations

SQL = r"""
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
        'queued', 0, '', '', '', TRUE, (s->>'keyed')::boolean, '', statement_timestamp(),
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
              AND j.state = 'queued' AND j.waiting_on > 0
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
            JOIN jobs_job j ON j.id = d.job AND j.state = 'queued' AND j.waiting_on > 0
            WHERE d.upstream = p_upstream
          UNION
            SELECT d.job, d.upstream, doomed.ends,
                   CASE WHEN d.on_failure = 'fail' THEN 'failed' ELSE 'cancelled' END
            FROM doomed
            JOIN jobs_dependency d ON d.upstream = doomed.job
            JOIN jobs_job j ON j.id = d.job AND j.state = 'queued' AND j.waiting_on > 0
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
        WHERE j.id = e.job AND j.state = 'queued' AND j.waiting_on > 0;
    END IF;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0012_effects"),
    ]

    operations = [migrations.RunSQL(SQL, reverse_sql=migrations.RunSQL.noop)]
