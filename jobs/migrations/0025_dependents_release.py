"""Jobs waiting for one that ends are released after it, in bounded steps.

The settle trigger released every waiting job inside the statement that ended the job they
waited for, so that statement cost what the fan-out was: with a few hundred thousand waiting
jobs it passed the statement timeout every time, and the job never recorded its outcome. It
now records a settlement (``jobs_settlement``), one insert whatever the fan-out, and
``jobs.queue.dependencies.release`` applies it in steps (``jobs_dependents_release``).

Enqueue with ``after=`` no longer writes the rows of the jobs waited for, which held their row
locks for the producer's whole transaction: a running job's lease renewal skipped it, and a
producer open past a lease made the job run twice. A deferred check at the producer's commit
(``jobs_dependency_check``) marks them instead, under a lock held only until that commit.

Going back puts 0024's trigger function back; the settlements not applied yet are applied
first, in the migration, so no waiting job is left behind.
"""

import importlib

import django.db.models.functions.datetime
from django.db import migrations, models

SQL = r"""
-- Edges already applied: those whose upstream has ended (their waiting jobs were released or
-- ended with it).
UPDATE jobs_dependency d SET settled = TRUE
WHERE NOT EXISTS (
    SELECT 1 FROM jobs_job j WHERE j.id = d.upstream AND j.state IN ('queued', 'running')
);

-- Applies an ended job's outcome to the waiting jobs p_jobs whose edge to it is not settled
-- yet (each edge once, whoever comes first): on success each has one fewer to wait for and is
-- due now when none is left; on failure or cancellation each ends as its edge says. Returns
-- how many waiting jobs changed.
CREATE FUNCTION jobs_dependents_release(p_upstream bigint, p_state text, p_jobs bigint[])
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
                key_held = e.on_failure = 'fail',
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

DROP FUNCTION jobs_dependents_settle(bigint, text);

-- An enqueue's jobs waiting for a job that was not finished when the enqueue read it; each
-- row lives from the insert to the check at the commit, which deletes it.
CREATE UNLOGGED TABLE jobs_dependency_check (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    upstream bigint NOT NULL,
    jobs bigint[] NOT NULL
);

-- As the enqueue commits: mark each job waited for, under its row lock (held from here to the
-- commit, not for the producer's whole transaction), and apply its outcome if it ended after
-- the enqueue read it: its release ran without these edges, which were not committed yet.
-- The first check of a transaction does all of its rows (no other transaction's are
-- visible), in the order of the jobs waited for: two producers locking them in opposite
-- orders could deadlock. The checks after it find their rows gone.
CREATE FUNCTION jobs_dependency_checked() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE CONSTRAINT TRIGGER jobs_dependency_checked
AFTER INSERT ON jobs_dependency_check
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION jobs_dependency_checked();
"""

PREVIOUS = importlib.import_module("jobs.migrations.0024_settle_by_key")

# 0024's trigger function: it released waiting jobs in the statement that ended their job.
SETTLED_IN_STATEMENT = r"""
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
        PERFORM jobs_dependents_settle(NEW.id, NEW.state);
    END IF;
    RETURN NULL;
END
$$;
"""

# Back: 0024's functions first, so the pending settlements applied here (in the order they
# were made, each to the edges made before a replay of its job) end whole chains at once,
# as 0024's trigger does; then what 0025 added goes.
REVERSE_SQL = (
    PREVIOUS.SQL
    + SETTLED_IN_STATEMENT
    + r"""
SELECT jobs_dependents_release(
    s.upstream, s.state,
    ARRAY(SELECT d.job FROM jobs_dependency d
          WHERE d.upstream = s.upstream AND NOT d.settled
            AND (s.cutoff IS NULL OR d.created_at < s.cutoff))
)
FROM jobs_settlement s ORDER BY s.id;
DELETE FROM jobs_settlement;
DROP TRIGGER jobs_dependency_checked ON jobs_dependency_check;
DROP FUNCTION jobs_dependency_checked();
DROP TABLE jobs_dependency_check;
DROP FUNCTION jobs_dependents_release(bigint, text, bigint[]);
"""
)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0024_settle_by_key"),
    ]

    operations = [
        migrations.CreateModel(
            name="Settlement",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("upstream", models.BigIntegerField(verbose_name="ended job")),
                ("state", models.CharField(max_length=16, verbose_name="ended as")),
                (
                    "created_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="ended at",
                    ),
                ),
                (
                    "cutoff",
                    models.DateTimeField(blank=True, null=True, verbose_name="replayed at"),
                ),
            ],
            options={
                "verbose_name": "settlement",
                "verbose_name_plural": "settlements",
            },
        ),
        migrations.AddField(
            model_name="dependency",
            name="settled",
            field=models.BooleanField(db_default=False, default=False, verbose_name="settled"),
        ),
        migrations.AddField(
            model_name="dependency",
            name="created_at",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(), verbose_name="created at"
            ),
        ),
        migrations.AddIndex(
            model_name="dependency",
            index=models.Index(
                condition=models.Q(("settled", False)),
                fields=["upstream", "job"],
                name="jobs_dependency_unsettled",
            ),
        ),
        migrations.AddIndex(
            model_name="settlement",
            index=models.Index(fields=["upstream", "id"], name="jobs_settlement_upstream"),
        ),
        migrations.RunSQL(SQL, reverse_sql=REVERSE_SQL),
    ]
