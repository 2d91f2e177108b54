"""The jobs app's tables, indexes and constraints (its functions and triggers: 0002).

The models describe most of it. What they cannot is SQL here: the partitioned history table,
the jobs table's storage settings and statistics, and the unlogged table of the deferred
dependency check.
"""

import django.db.models.deletion
import django.db.models.expressions
import django.db.models.functions.datetime
from django.db import migrations, models

import jobs.models

# The history table: partitioned by state, then by finished_at (jobs.queue.history adds and
# drops the time partitions under each state's partition as rows arrive and age).
HISTORY = """
CREATE TABLE jobs_jobhistory (
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
    archived_at timestamp with time zone NOT NULL DEFAULT statement_timestamp(),
    attempt_log jsonb NOT NULL DEFAULT '[]'::jsonb,
    batch_id bigint NULL,
    progress jsonb NULL
) PARTITION BY LIST (state);
CREATE TABLE jobs_jobhistory_succeeded PARTITION OF jobs_jobhistory
    FOR VALUES IN ('succeeded') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_jobhistory_failed PARTITION OF jobs_jobhistory
    FOR VALUES IN ('failed') PARTITION BY RANGE (finished_at);
CREATE TABLE jobs_jobhistory_cancelled PARTITION OF jobs_jobhistory
    FOR VALUES IN ('cancelled') PARTITION BY RANGE (finished_at);
-- get_result and replay by id; the monitor and the admin newest first; a batch's failures.
CREATE INDEX jobs_jobhistory_id ON jobs_jobhistory (id);
CREATE INDEX jobs_jobhistory_finished ON jobs_jobhistory (finished_at);
CREATE INDEX jobs_jobhistory_batch ON jobs_jobhistory (batch_id) WHERE batch_id IS NOT NULL;
"""

# The jobs table churns: every job is inserted, updated at least twice (claim, outcome) and
# moved out or deleted, so it makes dead row versions at the rate jobs run, whatever its size.
# Each claimed job also leaves a dead entry at the front of its type's range in the claim
# index, which every claim walks past until vacuum removes it. So vacuum it on a small fixed
# amount of churn, not on a fraction of its size, always clean its indexes, and let vacuum run
# unthrottled; leave a fifth of each page free so lease renewals stay HOT updates. Each value
# was chosen by draining a million jobs: docs/queue.md, "Table health".
SETTINGS = {
    "fillfactor": 80,
    "autovacuum_vacuum_scale_factor": 0.005,
    "autovacuum_vacuum_threshold": 1000,
    "autovacuum_vacuum_insert_scale_factor": 0.005,
    "autovacuum_vacuum_insert_threshold": 1000,
    "autovacuum_analyze_scale_factor": 0.01,
    "autovacuum_analyze_threshold": 1000,
    "autovacuum_vacuum_cost_delay": 0,
    "vacuum_index_cleanup": "on",
}
STORAGE = "ALTER TABLE jobs_job SET ({})".format(
    ", ".join(f"{key} = {value}" for key, value in SETTINGS.items())
)
STORAGE_RESET = "ALTER TABLE jobs_job RESET ({})".format(", ".join(SETTINGS))

# With state and name assumed independent, the planner's estimate of one type's queued rows
# is off by half where finished rows are mostly other types; the most-common-values list of
# the pair puts it within a few per cent. ANALYZE (autoanalyze) builds it.
STATISTICS = "CREATE STATISTICS jobs_job_state_name (mcv) ON state, name FROM jobs_job"
STATISTICS_DROP = "DROP STATISTICS jobs_job_state_name"

# An enqueue's jobs waiting for a job that was not finished when the enqueue read it; each
# row lives from the insert to the check at the commit (jobs_dependency_checked), which
# deletes it.
DEPENDENCY_CHECK = """
CREATE UNLOGGED TABLE jobs_dependency_check (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    upstream bigint NOT NULL,
    jobs bigint[] NOT NULL
);
"""


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="FlowGate",
            fields=[
                (
                    "name",
                    models.CharField(
                        max_length=200, primary_key=True, serialize=False, verbose_name="job type"
                    ),
                ),
                ("version", models.BigIntegerField(default=0)),
                ("tokens", models.FloatField(null=True)),
                (
                    "refilled_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                ("tenant_ordered", models.BooleanField(default=False)),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "flow gate",
                "verbose_name_plural": "flow gates",
                "db_table": "jobs_flow",
            },
        ),
        migrations.CreateModel(
            name="Process",
            fields=[
                (
                    "identity",
                    models.CharField(
                        max_length=200, primary_key=True, serialize=False, verbose_name="identity"
                    ),
                ),
                (
                    "component",
                    models.CharField(
                        choices=[("worker", "worker"), ("scheduler", "scheduler")],
                        max_length=16,
                        verbose_name="component",
                    ),
                ),
                ("host", models.CharField(max_length=200, verbose_name="host")),
                ("pid", models.IntegerField(verbose_name="pid")),
                ("version", models.CharField(max_length=40, verbose_name="version")),
                (
                    "scope",
                    models.CharField(blank=True, default="", max_length=200, verbose_name="scope"),
                ),
                (
                    "concurrency",
                    models.IntegerField(blank=True, null=True, verbose_name="concurrency"),
                ),
                ("held", models.IntegerField(default=0, verbose_name="jobs held")),
                ("draining", models.BooleanField(default=False, verbose_name="draining")),
                ("leader", models.BooleanField(default=False, verbose_name="leader")),
                (
                    "started_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="started at",
                    ),
                ),
                (
                    "last_seen_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="last seen at",
                    ),
                ),
                ("expires_at", models.DateTimeField(verbose_name="gone after")),
            ],
            options={
                "verbose_name": "process",
                "verbose_name_plural": "processes",
            },
        ),
        migrations.CreateModel(
            name="TenantBucket",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "name",
                        "tenant",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("name", models.CharField(max_length=200, verbose_name="job type")),
                ("tenant", models.CharField(max_length=64, verbose_name="tenant")),
                ("tokens", models.FloatField()),
                ("refilled_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "tenant bucket",
                "verbose_name_plural": "tenant buckets",
                "db_table": "jobs_flowtenant",
            },
        ),
        migrations.CreateModel(
            name="BacklogSample",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "period",
                        "width",
                        "name",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("period", models.DateTimeField(verbose_name="period")),
                ("width", models.IntegerField(verbose_name="width")),
                ("name", models.CharField(max_length=200, verbose_name="job type")),
                ("queued", models.BigIntegerField(verbose_name="queued")),
                ("due", models.BigIntegerField(verbose_name="due")),
                (
                    "oldest_due_seconds",
                    models.FloatField(blank=True, null=True, verbose_name="oldest due, waited"),
                ),
            ],
            options={
                "verbose_name": "backlog sample",
                "verbose_name_plural": "backlog samples",
                "indexes": [
                    models.Index(
                        condition=models.Q(("width", 60)),
                        fields=["period"],
                        name="jobs_backlogsample_minutes",
                    )
                ],
            },
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
                (
                    "settled",
                    models.BooleanField(db_default=False, default=False, verbose_name="settled"),
                ),
                (
                    "created_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="created at",
                    ),
                ),
            ],
            options={
                "verbose_name": "dependency",
                "verbose_name_plural": "dependencies",
                "indexes": [
                    models.Index(fields=["upstream"], name="jobs_dependency_upstream"),
                    models.Index(
                        condition=models.Q(("settled", False)),
                        fields=["upstream", "job"],
                        name="jobs_dependency_unsettled",
                    ),
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("on_failure__in", ["cancel", "fail"])),
                        name="jobs_dependency_on_failure_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("job", models.F("upstream")), _negated=True),
                        name="jobs_dependency_not_self",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="Effect",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "job", "step", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("job", models.BigIntegerField(verbose_name="job")),
                ("step", models.CharField(max_length=200, verbose_name="step")),
                ("key", models.CharField(max_length=64, verbose_name="effect key")),
                (
                    "state",
                    models.CharField(
                        choices=[("intent", "intent recorded"), ("done", "done")],
                        max_length=8,
                        verbose_name="state",
                    ),
                ),
                ("result", models.JSONField(blank=True, null=True, verbose_name="result")),
                ("attempt", models.PositiveIntegerField(verbose_name="attempt")),
                (
                    "started_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="intent recorded at",
                    ),
                ),
                (
                    "finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="done at"),
                ),
            ],
            options={
                "verbose_name": "effect",
                "verbose_name_plural": "effects",
                "indexes": [models.Index(fields=["started_at"], name="jobs_effect_started")],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("state__in", ["intent", "done"])),
                        name="jobs_effect_state_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("finished_at__isnull", True), ("state", "intent")),
                            models.Q(("finished_at__isnull", False), ("state", "done")),
                            _connector="OR",
                        ),
                        name="jobs_effect_done_has_finished_at",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="FairAccount",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "name",
                        "tenant",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("name", models.CharField(max_length=200, verbose_name="job type")),
                ("tenant", models.CharField(max_length=64, verbose_name="tenant")),
                ("served", models.FloatField(null=True)),
                ("starts", models.BigIntegerField(db_default=0)),
            ],
            options={
                "verbose_name": "fair account",
                "verbose_name_plural": "fair accounts",
                "indexes": [
                    models.Index(
                        condition=models.Q(("served__isnull", False)),
                        fields=["name", "served", "tenant"],
                        name="jobs_fairaccount_served",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Pause",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("job_type", "job type"),
                            ("queue", "queue"),
                            ("tenant", "tenant"),
                            ("schedule", "schedule"),
                        ],
                        max_length=16,
                        verbose_name="kind",
                    ),
                ),
                ("value", models.CharField(max_length=200, verbose_name="paused")),
                (
                    "reason",
                    models.CharField(blank=True, default="", max_length=200, verbose_name="reason"),
                ),
                (
                    "paused_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        editable=False,
                        verbose_name="paused at",
                    ),
                ),
                (
                    "paused_by",
                    models.CharField(
                        blank=True, default="", max_length=150, verbose_name="paused by"
                    ),
                ),
                ("until", models.DateTimeField(blank=True, null=True, verbose_name="until")),
            ],
            options={
                "verbose_name": "pause",
                "verbose_name_plural": "pauses",
                "permissions": [
                    ("pause_work", "Can pause and resume job types, queues, tenants and schedules")
                ],
                "constraints": [
                    models.UniqueConstraint(fields=("kind", "value"), name="jobs_pause_once"),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("kind__in", ["job_type", "queue", "tenant", "schedule"])
                        ),
                        name="jobs_pause_kind_valid",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="Rollup",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "period",
                        "width",
                        "name",
                        "outcome",
                        "code",
                        "shard",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                (
                    "period",
                    models.DateTimeField(
                        help_text="When the period starts.", verbose_name="period"
                    ),
                ),
                (
                    "width",
                    models.IntegerField(
                        help_text="The period's length in seconds.", verbose_name="width"
                    ),
                ),
                ("name", models.CharField(max_length=200, verbose_name="job type")),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("succeeded", "succeeded"),
                            ("failed", "failed"),
                            ("cancelled", "cancelled"),
                            ("retried", "retried"),
                        ],
                        max_length=16,
                        verbose_name="outcome",
                    ),
                ),
                (
                    "code",
                    models.CharField(
                        blank=True, default="", max_length=32, verbose_name="error code"
                    ),
                ),
                ("shard", models.IntegerField(verbose_name="shard")),
                ("count", models.BigIntegerField(verbose_name="attempts")),
                ("run_seconds", models.FloatField(verbose_name="run time, total")),
                ("wait_seconds", models.FloatField(verbose_name="queue latency, total")),
                ("run_histogram", jobs.models.HistogramField(verbose_name="run time histogram")),
                (
                    "wait_histogram",
                    jobs.models.HistogramField(verbose_name="queue latency histogram"),
                ),
            ],
            options={
                "verbose_name": "rollup",
                "verbose_name_plural": "rollups",
                "indexes": [
                    models.Index(
                        condition=models.Q(("width", 60)),
                        fields=["period"],
                        name="jobs_rollup_minutes",
                    )
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            ("outcome__in", ["succeeded", "failed", "cancelled", "retried"])
                        ),
                        name="jobs_rollup_outcome_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("width__gt", 0)), name="jobs_rollup_width_positive"
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="ScheduleSlot",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("schedule", models.CharField(max_length=64, verbose_name="schedule")),
                (
                    "slot",
                    models.DateTimeField(help_text="When the slot was due.", verbose_name="slot"),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("on_time", "On time"),
                            ("catch_up", "Catch-up"),
                            ("skipped", "Skipped"),
                        ],
                        max_length=16,
                        verbose_name="kind",
                    ),
                ),
                (
                    "missed_from",
                    models.DateTimeField(
                        blank=True,
                        help_text="The first missed slot this row stands for (catch-up and skipped rows).",
                        null=True,
                        verbose_name="missed from",
                    ),
                ),
                ("job_pk", models.BigIntegerField(blank=True, null=True, verbose_name="job row")),
                (
                    "job_id",
                    models.CharField(blank=True, default="", max_length=255, verbose_name="job id"),
                ),
                (
                    "recorded_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        editable=False,
                        verbose_name="recorded at",
                    ),
                ),
                (
                    "recorded_by",
                    models.CharField(
                        blank=True, default="", max_length=200, verbose_name="recorded by"
                    ),
                ),
            ],
            options={
                "verbose_name": "schedule slot",
                "verbose_name_plural": "schedule slots",
                "permissions": [
                    ("run_schedule", "Can run a schedule's job now, outside its slots")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("schedule", "slot"), name="jobs_scheduleslot_once"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("kind__in", ["on_time", "catch_up", "skipped"])),
                        name="jobs_scheduleslot_kind_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("job_id", ""), ("kind", "skipped")),
                            models.Q(
                                models.Q(("kind", "skipped"), _negated=True),
                                models.Q(("job_id", ""), _negated=True),
                            ),
                            _connector="OR",
                        ),
                        name="jobs_scheduleslot_fired_has_job_id",
                    ),
                ],
            },
        ),
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
                ("cutoff", models.DateTimeField(blank=True, null=True, verbose_name="replayed at")),
            ],
            options={
                "verbose_name": "settlement",
                "verbose_name_plural": "settlements",
                "indexes": [
                    models.Index(fields=["upstream", "id"], name="jobs_settlement_upstream")
                ],
            },
        ),
        migrations.CreateModel(
            name="TenantOverride",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("tenant", models.CharField(max_length=64, verbose_name="tenant")),
                ("component", models.CharField(max_length=64, verbose_name="component")),
                (
                    "note",
                    models.CharField(blank=True, default="", max_length=200, verbose_name="note"),
                ),
                (
                    "created_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        editable=False,
                        verbose_name="created at",
                    ),
                ),
            ],
            options={
                "verbose_name": "tenant override",
                "verbose_name_plural": "tenant overrides",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("tenant", "component"), name="jobs_tenantoverride_unique"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="TenantWeight",
            fields=[
                (
                    "tenant",
                    models.CharField(
                        max_length=64, primary_key=True, serialize=False, verbose_name="tenant"
                    ),
                ),
                ("weight", models.PositiveIntegerField(default=1, verbose_name="weight")),
            ],
            options={
                "verbose_name": "tenant weight",
                "verbose_name_plural": "tenant weights",
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("weight__gte", 1), ("weight__lte", 1000)),
                        name="jobs_tenantweight_range",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Job",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
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
                ("attempts", models.PositiveIntegerField(default=0, verbose_name="attempts")),
                (
                    "heartbeat_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="heartbeat at"),
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
                    "job_id",
                    models.CharField(
                        default=jobs.models.new_job_id, max_length=255, verbose_name="job id"
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        help_text="Versioned type name.", max_length=200, verbose_name="job type"
                    ),
                ),
                ("payload", models.JSONField(default=dict, verbose_name="payload")),
                (
                    "tenant",
                    models.CharField(
                        default=jobs.models.default_tenant, max_length=64, verbose_name="tenant"
                    ),
                ),
                (
                    "queue",
                    models.CharField(
                        default=jobs.models.default_queue, max_length=64, verbose_name="queue"
                    ),
                ),
                ("priority", models.SmallIntegerField(default=0, verbose_name="priority")),
                (
                    "max_attempts",
                    models.PositiveIntegerField(
                        default=jobs.models.default_max_attempts, verbose_name="max attempts"
                    ),
                ),
                (
                    "run_after",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        help_text="Earliest time the job may run; a scheduled retry moves it forward.",
                        verbose_name="run after",
                    ),
                ),
                (
                    "lease_expires_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="lease expires at"),
                ),
                (
                    "claim_token",
                    models.UUIDField(blank=True, null=True, verbose_name="claim token"),
                ),
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
                ("key_held", models.BooleanField(default=True, verbose_name="holds its job id")),
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
                    "keyed",
                    models.BooleanField(
                        db_default=True,
                        help_text="The job_id was given by the caller (an idempotency key), not generated.",
                        verbose_name="keyed",
                    ),
                ),
                (
                    "attempt_log",
                    models.JSONField(
                        db_default=models.Value([], output_field=models.JSONField()),
                        editable=False,
                        help_text="Every finished attempt: start, end, worker, outcome, error.",
                        verbose_name="attempts",
                    ),
                ),
                (
                    "cancel_requested_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="cancel requested at"),
                ),
                (
                    "cancel_requested_by",
                    models.CharField(
                        blank=True,
                        db_default="",
                        max_length=150,
                        verbose_name="cancel requested by",
                    ),
                ),
                (
                    "fair",
                    models.BooleanField(
                        db_default=False, editable=False, verbose_name="in tenant order"
                    ),
                ),
                (
                    "depended_on",
                    models.BooleanField(
                        db_default=False, editable=False, verbose_name="depended on"
                    ),
                ),
                (
                    "progress",
                    models.JSONField(
                        blank=True, editable=False, null=True, verbose_name="progress"
                    ),
                ),
                (
                    "waiting_on",
                    models.PositiveIntegerField(
                        db_default=0, editable=False, verbose_name="waiting on"
                    ),
                ),
                (
                    "batch",
                    models.ForeignKey(
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
            ],
            options={
                "verbose_name": "job",
                "verbose_name_plural": "jobs",
                "permissions": [
                    ("replay_job", "Can replay failed jobs"),
                    ("cancel_job", "Can cancel queued and running jobs"),
                ],
                "indexes": [
                    models.Index(
                        models.F("name"),
                        models.OrderBy(models.F("priority"), descending=True),
                        models.F("run_after"),
                        models.F("id"),
                        condition=models.Q(("state", "queued")),
                        name="jobs_job_claim",
                    ),
                    models.Index(
                        models.F("name"),
                        models.F("tenant"),
                        models.OrderBy(models.F("priority"), descending=True),
                        models.F("run_after"),
                        models.F("id"),
                        condition=models.Q(("fair", True), ("state", "queued")),
                        name="jobs_job_tenant_claim",
                    ),
                    models.Index(
                        condition=models.Q(("state", "running")),
                        fields=["name"],
                        name="jobs_job_running",
                    ),
                    models.Index(
                        condition=models.Q(("attempts__gt", 0), ("state", "queued")),
                        fields=["name", "attempts"],
                        name="jobs_job_retrying",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("attempts__gte", models.F("max_attempts")), ("state", "queued")
                        ),
                        fields=["id"],
                        name="jobs_job_out_of_attempts",
                    ),
                    models.Index(
                        condition=models.Q(("batch__isnull", False)),
                        fields=["batch"],
                        name="jobs_job_batch",
                    ),
                    models.Index(
                        condition=models.Q(("state__in", ("succeeded", "failed", "cancelled"))),
                        fields=["state", "key_held", "finished_at"],
                        name="jobs_job_terminal",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("key_held", True)),
                        fields=("tenant", "job_id"),
                        name="jobs_job_key_lock",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("key_held", True),
                            models.Q(("state__in", ("queued", "running")), _negated=True),
                            _connector="OR",
                        ),
                        name="jobs_job_active_holds_key",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("priority__gte", -100), ("priority__lte", 100)),
                        name="jobs_job_priority_range",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("max_attempts__gte", 1)),
                        name="jobs_job_max_attempts_positive",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("state__in", ["queued", "running", "succeeded", "failed", "cancelled"])
                        ),
                        name="jobs_job_state_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("state", "running"), _negated=True),
                            models.Q(
                                ("claim_token__isnull", False), ("lease_expires_at__isnull", False)
                            ),
                            _connector="OR",
                        ),
                        name="jobs_job_running_is_leased",
                    ),
                ],
            },
        ),
        # The history table is partitioned, which Django's schema editor cannot express: the
        # model's state is made as usual, the table itself by SQL.
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(HISTORY, "DROP TABLE jobs_jobhistory")],
            state_operations=[
                migrations.CreateModel(
                    name="JobHistory",
                    fields=[
                        (
                            "id",
                            models.BigIntegerField(
                                primary_key=True, serialize=False, verbose_name="id"
                            ),
                        ),
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
                        (
                            "attempt_log",
                            models.JSONField(
                                db_default=models.Value([], output_field=models.JSONField()),
                                editable=False,
                                verbose_name="attempts",
                            ),
                        ),
                        (
                            "batch_id",
                            models.BigIntegerField(blank=True, null=True, verbose_name="batch"),
                        ),
                        (
                            "progress",
                            models.JSONField(blank=True, null=True, verbose_name="progress"),
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
        migrations.RunSQL(STORAGE, reverse_sql=STORAGE_RESET),
        migrations.RunSQL(STATISTICS, reverse_sql=STATISTICS_DROP),
        migrations.RunSQL(DEPENDENCY_CHECK, reverse_sql="DROP TABLE jobs_dependency_check"),
    ]
