"""The history table: finished jobs, out of the claim path, retired a partition at a time.

The jobs table holds active work and the finished rows that still hold their idempotency key.
Every other finished row moves to ``jobs_jobhistory`` at the scheduler's archive pass, a
bounded ``DELETE … RETURNING`` into ``INSERT`` that reads the terminal-row index in order::

    jobs_job (queued, running, finished holding a key)
        │  archive: finished ARCHIVE_AFTER ago, and no key held (or its window passed)
        ▼
    jobs_jobhistory                        PARTITION BY LIST (state)
      └─ jobs_jobhistory_<state>           PARTITION BY RANGE (finished_at)
           └─ jobs_jobhistory_<state>_<from>_<to>   an hour (or a day) of finished rows
                │  retention: the partition's end is older than the state's retention
                ▼
              DROP TABLE

A state whose retention is three days or less gets an hour per partition (a row lives up to
an hour past its retention), a longer one a day per partition
(:mod:`jobs.queue.history_partitions` names, plans and makes them). A partition is created
just before the first row that needs it moves. Rows already past their retention when they
leave the jobs table are deleted, not moved.

Writers of the history never wait long on this module's DDL: each statement waits at most
``DDL_LOCK_TIMEOUT`` (a tenth of a second) for a lock, then the work is left for the next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, cast

from django.db import DEFAULT_DB_ALIAS, OperationalError
from django.db.backends.utils import CursorWrapper

from jobs.core.conf import jobs_settings
from jobs.queue import _db
from jobs.queue.history_partitions import DAY as DAY
from jobs.queue.history_partitions import HOUR as HOUR
from jobs.queue.history_partitions import PARENT as PARENT
from jobs.queue.history_partitions import Partition as Partition
from jobs.queue.history_partitions import create, ddl
from jobs.queue.history_partitions import partitions as partitions
from jobs.queue.history_partitions import plan as plan
from jobs.queue.history_partitions import utc as _utc
from jobs.runs import TERMINAL_STATES, RunState

logger = logging.getLogger("jobs.scheduler")

#: Retentions up to this long are kept in hourly partitions, longer ones in daily ones.
HOURLY_UP_TO = timedelta(days=3)

# Columns a history row has, in the order both INSERTs below write them.
COLUMNS = (
    "id, state, attempts, heartbeat_at, last_error, error_detail, created_at, finished_at, "
    "job_id, name, payload, tenant, queue, priority, max_attempts, run_after, claimed_by, "
    "started_at, keyed, result, replayed_at, replayed_by, attempt_log, batch_id, progress"
)

# One batch of one state: rows that let their key go, or (``held``) whose window has passed.
# Each is a plain ordered range of the terminal-row index, locked as it is read, so the plan
# stays right even while the statistics have not caught up with a burst of finished rows.
_ARCHIVE = f"""
WITH picked AS (
    SELECT j.id FROM jobs_job j
    WHERE j.state = %(state)s AND j.key_held = %(held)s AND j.finished_at < %(until)s
    ORDER BY j.finished_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
),
moved AS (
    -- By id through the primary key: a join here may hash the whole table instead.
    DELETE FROM jobs_job j WHERE j.id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING j.*
),
unlinked AS (
    -- What a finished job waited for matters no more once it leaves (jobs.queue.dependencies).
    DELETE FROM jobs_dependency d WHERE d.job = ANY(ARRAY(SELECT id FROM picked))
),
kept AS (
    INSERT INTO {PARENT} ({COLUMNS})
    SELECT {COLUMNS} FROM moved WHERE moved.finished_at >= %(expired_before)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM kept)
"""

_OLDEST = """
SELECT LEAST(
    (SELECT min(finished_at) FROM jobs_job WHERE state = %(state)s AND NOT key_held),
    (SELECT min(finished_at) FROM jobs_job WHERE state = %(state)s AND key_held)
)
"""

# A job cancelled while it waited for others never had a due time, which a row of the jobs
# table that waits for nothing needs (replay then makes it due now).
_RESTORED = COLUMNS.replace("run_after", "COALESCE(run_after, finished_at)")

#: Failed or cancelled history rows back into the jobs table, for replay to queue them.
RESTORE = f"""
WITH restored AS (
    DELETE FROM {PARENT} h
    WHERE h.id = ANY(%(ids)s) AND h.state IN ('failed', 'cancelled')
    RETURNING h.*
)
INSERT INTO jobs_job ({COLUMNS}, key_held, lease_expires_at, claim_token)
SELECT {_RESTORED}, FALSE, NULL, NULL FROM restored
RETURNING id
"""

#: Restored rows that replay then left alone (their key was taken) go back where they were.
UNRESTORE = f"""
WITH back AS (
    DELETE FROM jobs_job j
    WHERE j.id = ANY(%(ids)s) AND (j.state || '') IN ('failed', 'cancelled') AND NOT j.key_held
    RETURNING j.*
)
INSERT INTO {PARENT} ({COLUMNS}) SELECT {COLUMNS} FROM back
"""


def retention(state: str) -> timedelta:
    """How long finished rows of ``state`` are kept (the ``*_RETENTION`` settings)."""
    retentions: dict[str, timedelta] = {
        RunState.SUCCEEDED: jobs_settings.SUCCEEDED_RETENTION,
        RunState.FAILED: jobs_settings.FAILED_RETENTION,
        RunState.CANCELLED: jobs_settings.CANCELLED_RETENTION,
    }
    return retentions[state]


def window(state: str) -> timedelta:
    """How long a finished row of ``state`` holds its key (the two window settings)."""
    if state == RunState.SUCCEEDED:
        return jobs_settings.SUCCESS_WINDOW
    return jobs_settings.FAILURE_WINDOW


def width(state: str) -> timedelta:
    """The span of a new partition: an hour for short retentions, a day for long ones."""
    return HOUR if retention(state) <= HOURLY_UP_TO else DAY


def ensure(cur: CursorWrapper, state: str, first: datetime, last: datetime) -> list[Partition]:
    """Create the partitions rows of ``state`` finished in ``[first, last]`` need; the new ones.

    ``CREATE TABLE … (LIKE jobs_jobhistory)`` takes ACCESS SHARE on the history, as any reader
    does, and ``ATTACH PARTITION`` SHARE UPDATE EXCLUSIVE on the state's table, which neither
    readers nor writers of the history conflict with. Each statement waits at most
    ``DDL_LOCK_TIMEOUT`` for a lock; then the error (SQLSTATE 55P03) is the caller's, and
    nothing was created.
    """
    with ddl(cur):
        return create(cur, state, _utc(first), _utc(last), width(state))


def archive(
    *,
    batch_size: int = 5000,
    max_batches: int = 20,
    budget: float = 2.0,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, tuple[int, int]]:
    """Move finished rows that hold no key out of the jobs table; ``(moved, kept)`` per state.

    ``kept`` rows went to the history table; the rest were past their retention already and
    were deleted. At most ``max_batches`` statements of ``batch_size`` rows per state, and no
    new statement after ``budget`` seconds, so a backlog of finished rows is worked off over
    several passes without holding up the caller's loop. Call it outside a transaction: each
    batch commits on its own.
    """
    deadline = time.monotonic() + budget
    counts: dict[str, tuple[int, int]] = {}
    with _db.cursor(using) as cur:
        now = _utc(now or _clock(cur))
        cutoff = now - jobs_settings.ARCHIVE_AFTER
        for state in TERMINAL_STATES:
            expired_before = now - retention(state)
            cur.execute(_OLDEST, {"state": state})
            (oldest,) = cur.fetchone()
            if oldest is None or _utc(oldest) >= cutoff:
                continue
            try:
                # The next hour too, so its rows find their partition waiting.
                ensure(cur, state, max(_utc(oldest), expired_before), now + HOUR)
            except OperationalError as exc:
                if not _lock_timeout(exc):
                    raise
                _deferred(state)
                continue
            moved_total = kept_total = statements = 0
            # Rows that let go of their key, then key holders whose window has passed; the
            # two ranges share the state's max_batches statements.
            for held, until in ((False, cutoff), (True, min(cutoff, now - window(state)))):
                params: dict[str, Any] = {
                    "state": state,
                    "held": held,
                    "until": until,
                    "expired_before": expired_before,
                    "batch": batch_size,
                }
                while statements < max_batches:
                    statements += 1
                    cur.execute(_ARCHIVE, params)
                    moved, kept = cur.fetchone()
                    moved_total, kept_total = moved_total + moved, kept_total + kept
                    # Not "fewer than a batch": a concurrent pass may hold part of one locked.
                    if not moved or time.monotonic() > deadline:
                        break
            if moved_total:
                counts[state] = (moved_total, kept_total)
    return counts


def drop_expired(
    *,
    retentions: Mapping[str, timedelta] | None = None,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> dict[str, int]:
    """Drop history partitions wholly past their state's retention; rows dropped per state.

    The counts are PostgreSQL's estimate (``reltuples``) where the partition was analysed,
    an estimate from its size otherwise: a drop costs the same whatever the partition holds.
    A partition that waited for a lock is left for the next pass.
    """
    dropped: dict[str, int] = {}
    with _db.cursor(using) as cur:
        now = _utc(now or _clock(cur))
        for state in TERMINAL_STATES:
            age = (retentions or {}).get(state) or retention(state)
            for partition in partitions(cur, state):
                if partition.end > now - age:
                    break
                try:
                    rows = _drop(cur, partition)
                except OperationalError as exc:
                    if not _lock_timeout(exc):
                        raise
                    # A long reader of the history (a report, pg_dump): try again next pass.
                    logger.warning(
                        "retention: %s is in use (waited for a lock); next pass",
                        partition.name,
                        extra={"action": "drop_deferred", "partition": partition.name},
                    )
                    continue
                dropped[state] = dropped.get(state, 0) + rows
    return dropped


def _drop(cur: CursorWrapper, partition: Partition) -> int:
    """Drop one partition; the rows it held, as PostgreSQL's statistics estimate them.

    Never analysed, it is estimated from its size (about 40 rows a page): counting the rows
    would cost what the drop saves. ``DROP TABLE`` of a partition takes ACCESS EXCLUSIVE on
    the state's table, which waits for every reader and writer of that state's history and
    makes every later one wait behind it: so it waits at most ``DDL_LOCK_TIMEOUT``, and
    a lock timeout (SQLSTATE 55P03) is the caller's to leave for the next pass.
    """
    with ddl(cur):
        cur.execute(
            "SELECT CASE WHEN reltuples >= 0 THEN reltuples "
            "ELSE pg_relation_size(oid) / current_setting('block_size')::int * 40 END::bigint "
            "FROM pg_class WHERE oid = to_regclass(%s)",
            [partition.name],
        )
        found = cur.fetchone()
        if found is None:  # dropped by someone else meanwhile
            return 0
        cur.execute(f"DROP TABLE IF EXISTS {partition.name}")
    return int(found[0])


def _deferred(state: str) -> None:
    logger.warning(
        "archive: no partition for %s rows yet (waited for a lock); next pass",
        state,
        extra={"action": "archive_deferred", "state": state},
    )


def _clock(cur: CursorWrapper) -> datetime:
    cur.execute("SELECT statement_timestamp()")
    (now,) = cur.fetchone()
    return cast(datetime, now)


def _lock_timeout(exc: OperationalError) -> bool:
    """The statement gave up waiting for a lock (``lock_timeout``, SQLSTATE 55P03)."""
    return getattr(exc.__cause__, "sqlstate", None) == "55P03"
