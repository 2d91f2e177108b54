"""Storage settings of the jobs table, chosen by draining a million jobs (docs/queue.md, "Table
health"), and statistics that keep the backlog estimate close.

The jobs table churns: every job is inserted, updated at least twice (claim, outcome) and
moved out or deleted, so it makes dead row versions at the rate jobs run, whatever its size.
Each claimed job also leaves a dead entry at the front of its type's range in the claim
index, which every claim walks past until vacuum removes it: claim cost follows the dead
entries left since the last vacuum. So vacuum this table on a small fixed amount of churn,
not on a fraction of its size, and let it run unthrottled, as it is small and hot in cache.
"""

from django.db import migrations

#: The settings of migration 0001, restored by the reverse.
INITIAL = {
    "fillfactor": 80,
    "autovacuum_vacuum_scale_factor": 0.02,
    "autovacuum_vacuum_insert_scale_factor": 0.02,
    "autovacuum_analyze_scale_factor": 0.02,
    "autovacuum_vacuum_cost_delay": 1,
}

SETTINGS = {
    # Inserts leave a fifth of each page free: a lease renewal (no indexed column changes)
    # then stays a HOT update on the same page, and a claim or outcome update (not HOT: the
    # state is in index predicates) still writes its new version to the same page.
    "fillfactor": 80,
    # Vacuum after about 1,000 dead rows plus 0.5 % of the table: a backlog of millions no
    # longer postpones vacuum by the tens of thousands of dead entries the claims wade through.
    "autovacuum_vacuum_scale_factor": 0.005,
    "autovacuum_vacuum_threshold": 1000,
    # Inserted rows count too, so a burst of enqueues is vacuumed soon: the visibility map is
    # then set (index-only backlog counts) and the rows are frozen in small steps.
    "autovacuum_vacuum_insert_scale_factor": 0.005,
    "autovacuum_vacuum_insert_threshold": 1000,
    # Re-analyze after 1 % churn: the backlog's planner estimate follows the queue closely.
    "autovacuum_analyze_scale_factor": 0.01,
    "autovacuum_analyze_threshold": 1000,
    # Unthrottled: a vacuum that sleeps between pages lets dead entries pile up for longer.
    "autovacuum_vacuum_cost_delay": 0,
}

ALTER = "ALTER TABLE jobs_job SET ({})".format(
    ", ".join(f"{key} = {value}" for key, value in SETTINGS.items())
)
RESTORE = "ALTER TABLE jobs_job SET ({})".format(
    ", ".join(f"{key} = {value}" for key, value in INITIAL.items())
)
RESET = "ALTER TABLE jobs_job RESET ({})".format(
    ", ".join(key for key in SETTINGS if key not in INITIAL)
)

# With state and name assumed independent, the planner's estimate of one type's queued rows
# is off by half where finished rows are mostly other types (measured: 99,580 for 200,000);
# the most-common-values list of the pair puts it within a few per cent. ANALYZE (autoanalyze)
# builds it.
STATISTICS = (
    "CREATE STATISTICS IF NOT EXISTS jobs_job_state_name (mcv) ON state, name FROM jobs_job"
)
DROP_STATISTICS = "DROP STATISTICS IF EXISTS jobs_job_state_name"

REVERSE = [DROP_STATISTICS, RESET, RESTORE]


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_job_exhaustion_indexes"),
    ]

    # Both statements take a SHARE UPDATE EXCLUSIVE lock only: enqueues, claims and outcome
    # writes go on meanwhile (an autovacuum of the table in progress is cancelled).
    operations = [
        migrations.RunSQL(sql=ALTER, reverse_sql=[RESET, RESTORE]),
        migrations.RunSQL(sql=STATISTICS, reverse_sql=DROP_STATISTICS),
    ]
