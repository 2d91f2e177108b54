"""Prometheus metrics of the scheduler. Labels are bounded: schedule names (from settings),
run-table labels (from the app registry), duty names, fixed outcome words, job types, and the
jobs table's own PostgreSQL table and index names.

The backlog and table-health gauges are exported by the leader alone (the gauges duty,
:mod:`jobs.scheduler.gauges`); a standby exports none of them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

leader = Gauge("jobs_scheduler_leader", "1 while this scheduler process leads, 0 otherwise.")
leadership_changes = Counter(
    "jobs_scheduler_leadership_changes_total",
    "Leadership changes of this process: acquired, lost (could not prove it), released.",
    ["event"],
)
passes = Counter(
    "jobs_scheduler_passes_total", "Completed passes of each duty while leading.", ["duty"]
)
errors = Counter(
    "jobs_scheduler_errors_total", "Duty passes that failed (logged; retried next time).", ["duty"]
)
slots = Counter(
    "jobs_schedule_slots_total",
    "Slots recorded by this process: on_time and catch_up enqueued a job, skipped did not.",
    ["schedule", "kind"],
)
last_fired = Gauge(
    "jobs_schedule_last_fired_slot_timestamp_seconds",
    "Unix time of the latest slot that fired (0 if none has).",
    ["schedule"],
)
next_due = Gauge(
    "jobs_schedule_next_due_timestamp_seconds",
    "Unix time of the next slot that should fire.",
    ["schedule"],
)
overdue = Gauge(
    "jobs_schedule_overdue_seconds",
    "How long ago a slot that has not fired was due, once past the misfire grace; else 0.",
    ["schedule"],
)
reaped = Counter(
    "jobs_scheduler_reaped_total",
    "Rows the watchdog moved: jobs requeued or failed after their lease expired, run-table "
    "rows failed as stale.",
    ["table", "outcome"],
)
pruned = Counter("jobs_scheduler_pruned_total", "Rows deleted by retention.", ["table", "state"])
archived = Counter(
    "jobs_scheduler_archived_total", "Finished job rows moved to the history table.", ["state"]
)

# The gauges duty (leader only) ---------------------------------------------------------------

backlog = Gauge(
    "jobs_backlog",
    "Queued jobs (due or not, every tenant) by type, and whether the scheduler registers the "
    "type; exact up to jobs.queue.BACKLOG_CAP (1,000), the planner's estimate above.",
    ["job_type", "supported"],
)
oldest_due = Gauge(
    "jobs_backlog_oldest_due_seconds",
    "How long the longest-waiting due job of the type has been due (0: none is due).",
    ["job_type"],
)
live_tuples = Gauge(
    "jobs_table_live_tuples", "Live rows of the table (PostgreSQL's estimate).", ["table"]
)
dead_tuples = Gauge(
    "jobs_table_dead_tuples",
    "Dead row versions of the table that vacuum has not reclaimed yet (PostgreSQL's estimate).",
    ["table"],
)
table_size = Gauge(
    "jobs_table_size_bytes", "Size of the table with its TOAST data and maps.", ["table"]
)
index_size = Gauge(
    "jobs_table_index_size_bytes", "Size of each index of the table.", ["table", "index"]
)
last_autovacuum = Gauge(
    "jobs_table_last_autovacuum_timestamp_seconds",
    "Unix time of the table's last autovacuum (0 if none since statistics were reset).",
    ["table"],
)
last_autoanalyze = Gauge(
    "jobs_table_last_autoanalyze_timestamp_seconds",
    "Unix time of the table's last autoanalyze (0 if none since statistics were reset).",
    ["table"],
)

# Flow control, per job type with any (jobs.queue.flow); never per tenant.
flow_running = Gauge(
    "jobs_flow_running",
    "Jobs of the type running now on every worker, for types with flow control.",
    ["job_type"],
)
flow_limit = Gauge(
    "jobs_flow_limit",
    "The type's global concurrency: the most that may run at once across every worker.",
    ["job_type"],
)
flow_limited = Gauge(
    "jobs_flow_limited",
    "Due jobs of the type held back now by a limit with no room for them (the type full, its "
    "bucket empty, a throttle, or their tenant full); 0 while every limit has room.",
    ["job_type"],
)
flow_tokens = Gauge(
    "jobs_flow_rate_tokens",
    "Tokens left now in the type's rate-limit bucket (a start takes one).",
    ["job_type"],
)
flow_throttled = Gauge(
    "jobs_flow_throttled_seconds",
    "Seconds left of a throttle a handler asked for (RetryAfter(..., throttle=True)); 0: none.",
    ["job_type"],
)

#: Everything the gauges duty sets, withdrawn together when this process stops leading.
LEADER_GAUGES = (
    backlog,
    oldest_due,
    flow_running,
    flow_limit,
    flow_limited,
    flow_tokens,
    flow_throttled,
    live_tuples,
    dead_tuples,
    table_size,
    index_size,
    last_autovacuum,
    last_autoanalyze,
)
