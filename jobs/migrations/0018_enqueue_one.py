"""Every single-job insert as a function (``jobs_enqueue_one``).

``enqueue()`` inserts its job with one statement, which PostgreSQL parsed and planned anew for
every job: about 200 of the 340 µs of server CPU a job enqueued one by one cost. In a PL/pgSQL
function each connection keeps the plan, behind a transaction pooler too (nothing is prepared
by the protocol).

``SQL`` is what ``jobs.queue.enqueue.enqueue_function()`` returned when this migration was
written; a test compares them, so a change to the insert comes with a migration.
"""

from django.db import migrations

SQL = r"""
CREATE OR REPLACE FUNCTION jobs_enqueue_one(
    p_job_id text,
    p_name text,
    p_payload jsonb,
    p_tenant text,
    p_queue text,
    p_priority integer,
    p_max_attempts integer,
    p_run_after timestamptz,
    p_delay float8,
    p_keyed boolean,
    p_batch_id bigint,
    p_waiting_on integer,
    p_base timestamptz,
    p_channel text
) RETURNS TABLE (r_id bigint, r_inserted boolean, r_created_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY
    WITH inserted AS (
        INSERT INTO jobs_job (
            job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
            state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
            replayed_by, created_at, fair, batch_id, waiting_on
        )
        SELECT p_job_id, p_name, p_payload, p_tenant, p_queue, p_priority, p_max_attempts,
               COALESCE(p_run_after, b.at + make_interval(secs => p_delay)),
               'queued', 0, '', '', '', TRUE, p_keyed, '', b.at, (p_name = ANY((SELECT COALESCE(array_agg(f.name::text), '{}') FROM jobs_flow f WHERE f.tenant_ordered)::text[])), p_batch_id, p_waiting_on
        FROM (SELECT COALESCE(p_base, statement_timestamp()) AS at) b
        ON CONFLICT (tenant, job_id) WHERE key_held DO NOTHING
        RETURNING jobs_job.id, jobs_job.name, jobs_job.run_after, jobs_job.created_at
    ),
    notified AS (
        SELECT count(pg_notify(p_channel, i.name)) AS sent
        FROM inserted i WHERE p_channel IS NOT NULL AND i.run_after <= statement_timestamp()
    )
    SELECT i.id, TRUE, i.created_at FROM inserted i, notified;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0017_worker_fair_pass"),
    ]

    operations = [
        migrations.RunSQL(
            SQL,
            reverse_sql=(
                "DROP FUNCTION IF EXISTS jobs_enqueue_one(text, text, jsonb, text, text, integer, "
                "integer, timestamptz, float8, boolean, bigint, integer, timestamptz, text)"
            ),
        )
    ]
