"""Batches, dependencies and progress (issue: workflows).

The settle trigger keeps a batch's counts and releases or ends waiting jobs in the same
transaction as the state change of the job they follow, whatever statement made it (a
worker's outcome, an operator's cancel, the lease sweep, a replay). Its functions are the
SQL of jobs.queue.batches and jobs.queue.dependencies; a change to them is a new migration
that replaces them.
"""

import django.db.models.deletion
import django.db.models.expressions
import django.db.models.functions.datetime
from django.db import migrations, models

import jobs.models

SETTLE_SQL = r"""
-- The history's members of a batch, for the successor's list of failures.
CREATE INDEX jobs_jobhistory_batch ON jobs_jobhistory (batch_id) WHERE batch_id IS NOT NULL;

-- A batch's counts move by the deltas of one member's state change; the change that settles
-- the last member of a sealed batch fires its successor.
CREATE FUNCTION jobs_batch_settle(
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

-- Marks the batch finished and enqueues its successor, once: the fired_at guard under the
-- row lock makes every later call a no-op. The successor is the row the batch was opened
-- with, due now.
CREATE FUNCTION jobs_batch_fire(p_batch bigint) RETURNS void LANGUAGE plpgsql AS $$
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
        -- A caller-given successor job_id already held: that job is the successor.
        SELECT id INTO new_id FROM jobs_job
        WHERE tenant = s->>'tenant' AND job_id = s->>'job_id' AND key_held;
    ELSE
        PERFORM pg_notify('jobs_enqueued', s->>'name');
    END IF;
    UPDATE jobs_batch SET successor_pk = new_id WHERE id = p_batch;
END
$$;

-- A job others wait for has finished: on success each waiting job has one fewer to wait for
-- (and is due now when none is left); on failure or cancellation each waiting job ends as
-- its edge says. Their own state changes fire the trigger in turn, down the chain.
CREATE FUNCTION jobs_dependents_settle(p_upstream bigint, p_state text)
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
        UPDATE jobs_job j
        SET state = CASE WHEN d.on_failure = 'fail' THEN 'failed' ELSE 'cancelled' END,
            -- A cancelled job lets its job_id go at once, a failed one keeps it through
            -- its window (as operator cancels and failures do).
            key_held = d.on_failure = 'fail',
            waiting_on = 0,
            run_after = statement_timestamp(),
            finished_at = statement_timestamp(),
            last_error = 'dependency_failed',
            error_detail = format('job %s, which this job waited for, ended %s', p_upstream,
                                  p_state)
        FROM jobs_dependency d
        WHERE d.upstream = p_upstream AND j.id = d.job
          AND j.state = 'queued' AND j.waiting_on > 0;
    END IF;
END
$$;

CREATE FUNCTION jobs_job_settled() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- Only a change into or out of a terminal state of a member or of a job others wait for
-- calls the function; claims, renewals and every other job pay for the WHEN test alone.
CREATE TRIGGER jobs_job_settled
AFTER UPDATE OF state ON jobs_job
FOR EACH ROW
WHEN (
    OLD.state IS DISTINCT FROM NEW.state
    AND (OLD.state IN ('succeeded', 'failed', 'cancelled')
         OR NEW.state IN ('succeeded', 'failed', 'cancelled'))
    AND (NEW.batch_id IS NOT NULL OR NEW.depended_on)
)
EXECUTE FUNCTION jobs_job_settled();
"""

DROP_SETTLE_SQL = """
DROP TRIGGER IF EXISTS jobs_job_settled ON jobs_job;
DROP INDEX IF EXISTS jobs_jobhistory_batch;
DROP FUNCTION IF EXISTS jobs_job_settled();
DROP FUNCTION IF EXISTS jobs_batch_settle(bigint, integer, integer, integer);
DROP FUNCTION IF EXISTS jobs_batch_fire(bigint);
DROP FUNCTION IF EXISTS jobs_dependents_settle(bigint, text);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0009_job_tenant_claim_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="Dependency",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "job",
                        "upstream",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("job", models.BigIntegerField(verbose_name="waiting job")),
                ("upstream", models.BigIntegerField(verbose_name="waits for")),
                (
                    "on_failure",
                    models.CharField(
                        choices=[
                            ("cancel", "cancel the waiting job"),
                            ("fail", "fail the waiting job"),
                        ],
                        default="cancel",
                        max_length=8,
                        verbose_name="if it fails",
                    ),
                ),
            ],
            options={
                "verbose_name": "dependency",
                "verbose_name_plural": "dependencies",
            },
        ),
        migrations.AddField(
            model_name="job",
            name="depended_on",
            field=models.BooleanField(db_default=False, editable=False, verbose_name="depended on"),
        ),
        migrations.AddField(
            model_name="job",
            name="progress",
            field=models.JSONField(blank=True, editable=False, null=True, verbose_name="progress"),
        ),
        migrations.AddField(
            model_name="job",
            name="waiting_on",
            field=models.PositiveIntegerField(
                db_default=0, editable=False, verbose_name="waiting on"
            ),
        ),
        migrations.AddField(
            model_name="jobhistory",
            name="batch_id",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="batch"),
        ),
        migrations.AddField(
            model_name="jobhistory",
            name="progress",
            field=models.JSONField(blank=True, null=True, verbose_name="progress"),
        ),
        migrations.CreateModel(
            name="Batch",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "tenant",
                    models.CharField(
                        default=jobs.models.default_tenant, max_length=64, verbose_name="tenant"
                    ),
                ),
                (
                    "description",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="description"
                    ),
                ),
                (
                    "created_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        editable=False,
                        verbose_name="created at",
                    ),
                ),
                (
                    "created_by",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="created by"
                    ),
                ),
                (
                    "sealed_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="When the batch stopped waiting for its creator to add members.",
                        null=True,
                        verbose_name="sealed at",
                    ),
                ),
                ("total", models.PositiveIntegerField(default=0, verbose_name="members")),
                ("succeeded", models.PositiveIntegerField(default=0, verbose_name="succeeded")),
                ("failed", models.PositiveIntegerField(default=0, verbose_name="failed")),
                ("cancelled", models.PositiveIntegerField(default=0, verbose_name="cancelled")),
                (
                    "successor",
                    models.JSONField(
                        blank=True, editable=False, null=True, verbose_name="successor"
                    ),
                ),
                (
                    "successor_pk",
                    models.BigIntegerField(blank=True, null=True, verbose_name="successor job"),
                ),
                (
                    "fired_at",
                    models.DateTimeField(
                        blank=True,
                        help_text="When the last member finished and the successor was enqueued.",
                        null=True,
                        verbose_name="finished at",
                    ),
                ),
            ],
            options={
                "verbose_name": "batch",
                "verbose_name_plural": "batches",
                "indexes": [
                    models.Index(
                        condition=models.Q(("successor_pk__isnull", False)),
                        fields=["successor_pk"],
                        name="jobs_batch_successor",
                    ),
                    models.Index(
                        condition=models.Q(("fired_at__isnull", False)),
                        fields=["fired_at"],
                        name="jobs_batch_fired",
                    ),
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            (
                                "total__gte",
                                django.db.models.expressions.CombinedExpression(
                                    django.db.models.expressions.CombinedExpression(
                                        models.F("succeeded"), "+", models.F("failed")
                                    ),
                                    "+",
                                    models.F("cancelled"),
                                ),
                            )
                        ),
                        name="jobs_batch_counts_within_total",
                    )
                ],
            },
        ),
        migrations.AddField(
            model_name="job",
            name="batch",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                editable=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="jobs",
                to="jobs.batch",
                verbose_name="batch",
            ),
        ),
        migrations.AddIndex(
            model_name="dependency",
            index=models.Index(fields=["upstream"], name="jobs_dependency_upstream"),
        ),
        migrations.AddConstraint(
            model_name="dependency",
            constraint=models.CheckConstraint(
                condition=models.Q(("on_failure__in", ["cancel", "fail"])),
                name="jobs_dependency_on_failure_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="dependency",
            constraint=models.CheckConstraint(
                condition=models.Q(("job", models.F("upstream")), _negated=True),
                name="jobs_dependency_not_self",
            ),
        ),
        migrations.RunSQL(SETTLE_SQL, DROP_SETTLE_SQL),
    ]
