"""Storage settings of the jobs table, chosen by draining a million jobs (docs/queue.md, "Table
health"), and statistics that keep the backlog estimate close.

The jobs table churns: every job is inserted, updated at least twice (claim, outcome) and
moved out or deleted, so it makes dead row versions at the rate jobs run, whatever its size.
Each claimed job also leaves a dead entry at the front of its type's range in the claim
index, which every claim walks past until vacuum removes it: claim cost follows the dead
entries left since the last vacuum. So vacuum this table on a small fixed amount of churn,
not on a fraction of its size, always clean its indexes, and let it run unthrottled, as it is
small and hot in cache. How often autovacuum looks at all is the server's
``autovacuum_naptime`` (1 min by default), which no table setting can shorten: see the docs.
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
    # Inserts leave a fifth of each page free. A lease renewal changes no indexed column, so
    # with room on its page it is a HOT update: measured 38 % of renewals at 80, 17 % at 90,
    # none at 100. Claims and outcomes are never HOT (the state is in index predicates), but
    # their new versions stay on the page more often: 56 % moved to another page at 80, 90 %
    # at 100 (5 % less WAL). It costs 27 % more table; 60 would cost 68 % for little more.
    "fillfactor": 80,
    # Vacuum after about 1,000 dead rows plus 0.5 % of the table, not 20 % (PostgreSQL) or 2 %
    # (0001): on a million rows the old thresholds let tens of thousands of dead entries wait
    # in front of the claims, and after a drain 18,000 of them stayed for good (below 0001's
    # 20,000), keeping claims at 1.4x; here the table was vacuumed and claims came back to 1.04x.
    "autovacuum_vacuum_scale_factor": 0.005,
    "autovacuum_vacuum_threshold": 1000,
    # Inserted rows count too, so a burst of enqueues is vacuumed soon: the visibility map is
    # then set (index-only backlog counts) and the rows are frozen in small steps.
    "autovacuum_vacuum_insert_scale_factor": 0.005,
    "autovacuum_vacuum_insert_threshold": 1000,
    # Re-analyze after 1 % churn: the backlog's planner estimate follows the queue closely.
    "autovacuum_analyze_scale_factor": 0.01,
    "autovacuum_analyze_threshold": 1000,
    # Unthrottled: a vacuum that sleeps between pages leaves the dead entries in place for
    # longer (a million-row table: 1.5 s per vacuum against 3.2 s at 0001's 1 ms).
    "autovacuum_vacuum_cost_delay": 0,
    # Always vacuum the indexes. By default a vacuum that finds dead rows on under 2 % of the
    # table's pages skips them, and on a large table that is most vacuums: the heap is cleaned
    # but the claim index keeps every dead entry, and claims keep stepping over them. Measured
    # with 9,000,000 finished rows beside a drain of 1,000,000: claim cost during the drain
    # 2.9x idle (p95 4.7x) with the skip, 2.0x (p95 2.9x) without it.
    "vacuum_index_cleanup": "on",
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
