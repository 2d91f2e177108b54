"""Prometheus metrics of the scheduler. Labels are bounded: schedule names (from settings),
run-table labels (from the app registry), duty names and fixed outcome words."""

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
