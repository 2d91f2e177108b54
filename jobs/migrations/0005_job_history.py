import django.db.models.functions.datetime
from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models

# The history table is partitioned, which Django's schema editor cannot express: the model's
# state is created as usual, the table itself by this SQL (jobs.queue.history adds and drops
# the time partitions under each state's partition as rows arrive and age).
HISTORY_COLUMNS = """
    id bigint NOT NULL,
    state varchar(16) NOT NULL,
    attempts integer NOT NULL,
    heartbeat_at timestamp with time zone NULL,
    last_error varchar(32) NOT NULL,
    error_detail text NOT NULL,
    created_at timestamp with time zone NOT NULL DEFAULT statement_timestamp(),
    finished_at timestamp with time zone NOT NULL,
    job_id varchar(255) NOT NULL,
    name varchar(200) NOT NULL,
    payload jsonb NOT NULL,
    tenant varchar(64) NOT NULL,
    queue varchar(64) NOT NULL,
    priority smallint NOT NULL,
    max_attempts integer NOT NULL,
    run_after timestamp with time zone NOT NULL,
    claimed_by varchar(200) NOT NULL,
    started_at timestamp with time zone NULL,
    keyed boolean NOT NULL DEFAULT true,
    result jsonb NULL,
    replayed_at timestamp with time zone NULL,
    replayed_by varchar(150) NOT NULL,
    archived_at timestamp with time zone NOT NULL DEFAULT statement_timestamp()
"""

CREATE_HISTORY = f"""
CREATE TABLE jobs_jobhistory ({HISTORY_COLUMNS}) PARTITION BY LIST (state);
CREATE TABLE jobs_jobhistory_succeeded PARTITION OF jobs_jobhistory
    FOR VALUES IN ('succeeded') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_jobhistory_failed PARTITION OF jobs_jobhistory
    FOR VALUES IN ('failed') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_jobhistory_cancelled PARTITION OF jobs_jobhistory
    FOR VALUES IN ('cancelled') PARTITION BY RANGE (finished_at);
-- get_result and replay by id; the monitor and the admin newest first.
CREATE INDEX jobs_jobhistory_id ON jobs_jobhistory (id);
CREATE INDEX jobs_jobhistory_finished ON jobs_jobhistory (finished_at);
"""


class Migration(migrations.Migration):
    # The new terminal-row index is built concurrently: on a large jobs table a plain CREATE
    # INDEX would block enqueues and claims for as long as it reads the table.
    atomic = False

    dependencies = [
        ("jobs", "0004_job_storage_settings"),
    ]

    operations = [
        # Existing rows count as keyed: they keep their window, as they were promised.
        migrations.AddField(
            model_name="job",
            name="keyed",
            field=models.BooleanField(
                db_default=True,
                help_text="The job_id was given by the caller (an idempotency key), not generated.",
                verbose_name="keyed",
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state__in", ("succeeded", "failed", "cancelled"))),
                fields=["state", "key_held", "finished_at"],
                name="jobs_job_terminal",
            ),
        ),
        RemoveIndexConcurrently(model_name="job", name="jobs_job_finished"),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(CREATE_HISTORY, "DROP TABLE jobs_jobhistory"),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="JobHistory",
                    fields=[
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("queued", "Queued"),
                                    ("running", "Running"),
                                    ("succeeded", "Succeeded"),
                                    ("failed", "Failed"),
                                    ("cancelled", "Cancelled"),
                                ],
                                default="queued",
                                max_length=16,
                                verbose_name="state",
                            ),
                        ),
                        (
                            "attempts",
                            models.PositiveIntegerField(default=0, verbose_name="attempts"),
                        ),
                        (
                            "heartbeat_at",
                            models.DateTimeField(
                                blank=True, null=True, verbose_name="heartbeat at"
                            ),
                        ),
                        (
                            "last_error",
                            models.CharField(
                                blank=True, default="", max_length=32, verbose_name="last error"
                            ),
                        ),
                        (
                            "error_detail",
                            models.TextField(blank=True, default="", verbose_name="error detail"),
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
                            "finished_at",
                            models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
                        ),
                        (
                            "id",
                            models.BigIntegerField(
                                primary_key=True, serialize=False, verbose_name="id"
                            ),
                        ),
                        ("job_id", models.CharField(max_length=255, verbose_name="job id")),
                        ("name", models.CharField(max_length=200, verbose_name="job type")),
                        ("payload", models.JSONField(default=dict, verbose_name="payload")),
                        ("tenant", models.CharField(max_length=64, verbose_name="tenant")),
                        ("queue", models.CharField(max_length=64, verbose_name="queue")),
                        ("priority", models.SmallIntegerField(default=0, verbose_name="priority")),
                        ("max_attempts", models.PositiveIntegerField(verbose_name="max attempts")),
                        ("run_after", models.DateTimeField(verbose_name="run after")),
                        (
                            "claimed_by",
                            models.CharField(
                                blank=True, default="", max_length=200, verbose_name="claimed by"
                            ),
                        ),
                        (
                            "started_at",
                            models.DateTimeField(blank=True, null=True, verbose_name="started at"),
                        ),
                        ("keyed", models.BooleanField(default=True, verbose_name="keyed")),
                        ("result", models.JSONField(blank=True, null=True, verbose_name="result")),
                        (
                            "replayed_at",
                            models.DateTimeField(blank=True, null=True, verbose_name="replayed at"),
                        ),
                        (
                            "replayed_by",
                            models.CharField(
                                blank=True, default="", max_length=150, verbose_name="replayed by"
                            ),
                        ),
                        (
                            "archived_at",
                            models.DateTimeField(
                                db_default=django.db.models.functions.datetime.Now(),
                                editable=False,
                                verbose_name="archived at",
                            ),
                        ),
                    ],
                    options={
                        "verbose_name": "finished job",
                        "verbose_name_plural": "finished jobs",
                        "db_table": "jobs_jobhistory",
                    },
                ),
            ],
        ),
    ]
