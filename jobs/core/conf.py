"""The ``JOBS`` settings dict: documented defaults, read lazily, reset by ``override_settings``.

Durations may be given as :class:`~datetime.timedelta` or as a number of seconds; they are always
read back as ``timedelta``. Invalid values are reported by the system checks in
:mod:`jobs.checks` with stable ids, not by a crash later.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

#: Every setting with its default. The README's configuration table documents each one.
DEFAULTS: dict[str, Any] = {
    # Tenant stored on jobs enqueued without one.
    "DEFAULT_TENANT": "default",
    # Queue label stored on jobs enqueued without one.
    "DEFAULT_QUEUE": "default",
    # The Django database alias of job types that name none (``@job(..., database=...)``):
    # where enqueue puts their jobs unless told ``using=``, what ``runworker`` serves by
    # default, and where the scheduler leads from. See docs/databases.md.
    "DATABASE": "default",
    # Every alias that holds jobs tables, for the scheduler's duties and the admin. None:
    # DATABASE, every alias a registered job type names, and the task backends' DATABASE.
    "DATABASES": None,
    # Attempts allowed to jobs enqueued without a policy or explicit limit.
    "DEFAULT_MAX_ATTEMPTS": 5,
    # Lease a claim holds before another worker may take the job (PostgreSQL clock).
    "LEASE": timedelta(seconds=10),
    # A succeeded job keeps its job_id this long: a repeat enqueue returns it, runs nothing.
    "SUCCESS_WINDOW": timedelta(hours=24),
    # A failed job keeps its job_id this long before the same work may be submitted again.
    "FAILURE_WINDOW": timedelta(minutes=1),
    # Terminal rows are deleted this long after they finished (see prune()).
    "SUCCEEDED_RETENTION": timedelta(hours=24),
    "FAILED_RETENTION": timedelta(days=14),
    "CANCELLED_RETENTION": timedelta(days=7),
    # A finished batch (its successor enqueued) is deleted this long after it finished, as
    # is a batch never sealed and with no member left in the jobs table.
    "BATCH_RETENTION": timedelta(days=14),
    # Rows deleted per statement when pruning, so no statement holds locks for long.
    "PRUNE_BATCH_SIZE": 1000,
    # A finished job that holds no key (enqueued without a job_id, or past its window) moves
    # from the jobs table to the history table (jobs_jobhistory) this long after finishing,
    # at the scheduler's next archive pass. 0 moves it at the next pass.
    "ARCHIVE_AFTER": timedelta(seconds=10),
    # Send a NOTIFY on enqueue so idle workers wake at once (turn off behind
    # transaction-mode poolers that drop notifications; workers then poll).
    "NOTIFY": True,
    # A running row of a run table without a heartbeat for this long is reaped as stale.
    "STALE_AFTER": timedelta(seconds=60),
    # Retry backoff of job types whose policy sets none: after failed attempt n, wait a random
    # delay (full jitter) up to BACKOFF_BASE * 2**(n-1), never more than BACKOFF_CAP.
    "BACKOFF_BASE": timedelta(seconds=1),
    "BACKOFF_CAP": timedelta(seconds=300),
    # A retry due within this long is waited out in the worker (keeping the slot); a longer
    # one goes back to the queue and frees the slot. Policies may override it; 0 never waits.
    "RETRY_IN_PROCESS_UP_TO": timedelta(seconds=60),
    # A worker's handler threads reuse their database connection for up to this long (0:
    # a new connection for every job, like CONN_MAX_AGE = 0 for requests).
    "HANDLER_CONN_MAX_AGE": timedelta(seconds=60),
    # Cron schedules run by ``manage.py runscheduler``, by name: {"nightly": {"cron": "0 3 * * *",
    # "job": "reports.nightly.v1", "payload": {...}, "misfire": "once", ...}}. See
    # docs/scheduler.md; schedules may also be declared in code with jobs.scheduler.schedule().
    "SCHEDULES": {},
    # A slot this late still fires as on time; a later one is a misfire (handled by the
    # schedule's misfire policy) and counts as overdue.
    "MISFIRE_GRACE": timedelta(seconds=60),
    # A scheduler leader that has not proved itself for this long loses its term's transaction
    # (idle_in_transaction_session_timeout, set for that transaction only) and with it
    # leadership, so a stalled or cut-off
    # leader hands over to a standby; a leader whose loop has not moved for this long (a duty
    # stuck in a call) steps down itself.
    "SCHEDULER_LEADER_TIMEOUT": timedelta(seconds=10),
    # Bounds on the database calls of the worker's and the scheduler's own connections (never
    # on handlers'), applied by jobs.db.bounds as libpq connection parameters; 0 turns one off.
    # statement_timeout of their statements: a statement running or waiting longer is
    # cancelled, and the loop retries. Keep it well below SCHEDULER_LEADER_TIMEOUT.
    "DB_STATEMENT_TIMEOUT": timedelta(seconds=5),
    # lock_timeout of their statements: a wait for a lock another session holds gives up.
    "DB_LOCK_TIMEOUT": timedelta(seconds=2),
    # A connection whose network path goes dead (sent data unacknowledged, keepalive probes
    # unanswered) is dropped after about this long: tcp_user_timeout and TCP keepalives.
    "DB_NETWORK_TIMEOUT": timedelta(seconds=10),
    # Prepare the queue's statements (enqueue, claim, pass, outcomes, renewal) on every
    # connection it uses, the worker's own included: the server parses and plans each once a
    # connection. For direct connections, and PgBouncer 1.21+ with max_prepared_statements;
    # transaction poolers that cannot carry them refuse it (docs/operating-at-scale.md). The
    # database's OPTIONS["prepare_threshold"] never turns it on.
    "PREPARED_STATEMENTS": False,
    # Recorded cron slots are deleted this long after their slot time (each schedule's latest
    # slot is always kept: it is where the next tick starts).
    "SLOT_RETENTION": timedelta(days=30),
    # A process row (jobs_process) whose process stopped beating is shown as gone, then deleted
    # this long after it went gone, by the scheduler's retention pass.
    "PROCESS_RETENTION": timedelta(hours=1),
    # The console's history (jobs_rollup, jobs_backlogsample: counts, run times and queue
    # latencies per minute, folded to hours after two hours) is kept this long, by the
    # scheduler's retention pass. Much longer than job rows, at a few rows per type and hour.
    "ROLLUP_RETENTION": timedelta(days=30),
    # The console's live pages (monitor, jobs list, processes, overview) fetch themselves
    # again this often while open and not paused.
    "LIVE_REFRESH": timedelta(seconds=5),
}

DURATION_KEYS = frozenset(key for key, value in DEFAULTS.items() if isinstance(value, timedelta))

#: The PostgreSQL channel that enqueue notifies and workers listen on.
NOTIFY_CHANNEL = "jobs_enqueued"


def as_timedelta(value: timedelta | float | int) -> timedelta:
    """Accept seconds or a timedelta (the two spellings settings allow)."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a timedelta or a number of seconds, got {value!r}")
    return timedelta(seconds=value)


class JobsSettings:
    """Attribute access to ``settings.JOBS`` merged over :data:`DEFAULTS`.

    The annotations below give each setting its type for the type checker (values the system
    checks accept; durations already read as timedelta). They create no class attributes, so
    every read still goes through ``__getattr__``; a unit test keeps them in step with DEFAULTS.
    """

    DEFAULT_TENANT: str
    DEFAULT_QUEUE: str
    DATABASE: str
    DATABASES: list[str] | tuple[str, ...] | None
    DEFAULT_MAX_ATTEMPTS: int
    LEASE: timedelta
    SUCCESS_WINDOW: timedelta
    FAILURE_WINDOW: timedelta
    SUCCEEDED_RETENTION: timedelta
    FAILED_RETENTION: timedelta
    CANCELLED_RETENTION: timedelta
    BATCH_RETENTION: timedelta
    PRUNE_BATCH_SIZE: int
    ARCHIVE_AFTER: timedelta
    NOTIFY: bool
    STALE_AFTER: timedelta
    BACKOFF_BASE: timedelta
    BACKOFF_CAP: timedelta
    RETRY_IN_PROCESS_UP_TO: timedelta
    HANDLER_CONN_MAX_AGE: timedelta
    SCHEDULES: dict[str, Any]
    MISFIRE_GRACE: timedelta
    SCHEDULER_LEADER_TIMEOUT: timedelta
    DB_STATEMENT_TIMEOUT: timedelta
    DB_LOCK_TIMEOUT: timedelta
    DB_NETWORK_TIMEOUT: timedelta
    PREPARED_STATEMENTS: bool
    SLOT_RETENTION: timedelta
    PROCESS_RETENTION: timedelta
    ROLLUP_RETENTION: timedelta
    LIVE_REFRESH: timedelta

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    @property
    def user_settings(self) -> dict[str, Any]:
        return getattr(settings, "JOBS", None) or {}

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(f"unknown JOBS setting {name!r}")
        if name not in self._cache:
            value = self.user_settings.get(name, DEFAULTS[name])
            if name in DURATION_KEYS:
                value = as_timedelta(value)
            self._cache[name] = value
        return self._cache[name]

    def reload(self) -> None:
        self._cache.clear()


jobs_settings = JobsSettings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting == "JOBS":
        jobs_settings.reload()


setting_changed.connect(_reload)
