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
(:mod:`jobs.queue.history_partitions` names, plans and makes them). Rows already past their
retention when they leave the jobs table are deleted, not moved.

Ready ahead. The worker's pass may write a row it ends straight into the history, in the
statement that ends it, where no DDL can run and no missing partition may fail it. So every
archive pass first makes the partitions of the next :data:`LOOKAHEAD` widths (two hours, or
two days) and records in ``jobs_historyready`` up to when each state is covered without a gap
(:func:`prepare_ahead`); the pass reads that in :data:`READY_UNTIL`. Once all is ready, that
costs one read of the catalog: partitions are made, and ``until`` moves, once an hour (or a
day) per state.

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
from jobs.queue.history_partitions import create, ddl, parsed
from jobs.queue.history_partitions import partitions as partitions
from jobs.queue.history_partitions import plan as plan
from jobs.queue.history_partitions import utc as _utc
from jobs.runs import TERMINAL_STATES, RunState

logger = logging.getLogger("jobs.scheduler")

#: Retentions up to this long are kept in hourly partitions, longer ones in daily ones.
HOURLY_UP_TO = timedelta(days=3)
#: Partitions are made this many widths ahead of now: two hours, or two days.
LOOKAHEAD = 2

#: The time up to which the history is ready for finished rows of one state, as one SQL
#: expression: ``{state}`` is replaced by the SQL of the state (a column, or a parameter).
#:
#: The contract for a statement that ends a job and writes its row straight into the history:
#: a row of state S finished at T may be INSERTed into ``jobs_jobhistory`` if and only if
#: T < READY_UNTIL for S. NULL (no row for S yet) means "not ready": the row stays in
#: ``jobs_job``, where the archive pass moves it later. T is the statement's own
#: ``statement_timestamp()``: every time from the database clock at which the scheduler set
#: the value up to it has its partition attached, and retention never drops a partition that
#: reaches the clock (any drop of one lowers the value in the same transaction). The read is
#: one primary-key look-up in a table of at most three rows.
READY_UNTIL = "(SELECT r.until FROM jobs_historyready r WHERE r.state = {state})"
#: The same for every end at once: the states the history is ready for now, as a text array
#: (empty, never NULL, when none is), read once a statement (the outcome write's ``leaves``).
READY_STATES = (
    "(SELECT COALESCE(array_agg(r.state::text), '{}') FROM jobs_historyready r"
    " WHERE r.until > statement_timestamp())::text[]"
)

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


# Every state's partitions and its ready time, with the clock: what prepare_ahead needs to see
# that nothing is to be done, in one statement. (A cast of the name to regclass takes no lock.)
_LAYOUT = f"""
SELECT s.state, r.until, statement_timestamp(), ARRAY(
    SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = ('{PARENT}_' || s.state)::regclass
)
FROM unnest(%(states)s::text[]) AS s(state)
LEFT JOIN jobs_historyready r ON r.state = s.state
"""

_READY = """
INSERT INTO jobs_historyready (state, until) VALUES (%(state)s, %(until)s)
ON CONFLICT (state) DO UPDATE SET until = EXCLUDED.until
"""

# A partition that reaches the clock is being dropped: the state is ready up to its start at
# most. (Retention never drops one; a drop run with a time ahead of the clock may.)
_UNREADY = """
UPDATE jobs_historyready SET until = %(start)s
WHERE state = %(state)s AND until > %(start)s AND %(end)s > statement_timestamp()
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


#: How long before the scheduler's clock a statement that ends a job may have read its own and
#: still find ``until`` set: a statement reads its clock when it starts, and the table after
#: waiting for a lock, or later still inside a database function. The partitions from this
#: long before now are made and counted too, so a pass that started just before an hour
#: began finds the previous hour's partition there.
CLOCK_SKEW = timedelta(minutes=1)


def prepare_ahead(
    now: datetime | None = None, using: str = DEFAULT_DB_ALIAS
) -> dict[str, datetime | None]:
    """Make the history ready for rows finishing from ``now`` to :data:`LOOKAHEAD` widths
    ahead, and record it for :data:`READY_UNTIL`; each state's ready time (None: not ready).

    ``until`` becomes the end of the partitions that follow one another without a gap from
    the one holding :data:`CLOCK_SKEW` before ``now`` (default: the database clock). The
    archive duty calls it every pass: when every partition is there and every ``until`` is
    right, that is one read of the catalog, with no DDL and no write. A state
    whose partitions waited for a lock keeps its ``until`` and is tried again next pass. Call
    it outside a transaction: each state that changes commits on its own.
    """
    ready: dict[str, datetime | None] = {}
    with _db.cursor(using) as cur:
        cur.execute(_LAYOUT, {"states": list(TERMINAL_STATES)})
        for state, until, clock, names in cur.fetchall():
            now = _utc(now or clock)
            # From a moment before: a statement reads its clock before it reads the table.
            since = now - CLOCK_SKEW
            last = now + LOOKAHEAD * width(state)
            until = None if until is None else _utc(until)
            existing = parsed(names)
            if until == _ready_until(existing, since) and not plan(
                existing, state, since, last, width(state)
            ):
                ready[state] = until
                continue
            try:
                ready[state] = _prepare(cur, state, since, last)
            except OperationalError as exc:
                if not _lock_timeout(exc):
                    raise
                _deferred(state)
                ready[state] = until
    return ready


def _prepare(cur: CursorWrapper, state: str, now: datetime, last: datetime) -> datetime | None:
    """Create what is missing, then record the coverage, under the lock that drops take too."""
    with ddl(cur):
        create(cur, state, now, last, width(state))
        until = _ready_until(partitions(cur, state), now)
        if until is None:
            cur.execute("DELETE FROM jobs_historyready WHERE state = %s", [state])
        else:
            cur.execute(_READY, {"state": state, "until": until})
    return until


def _ready_until(layout: list[Partition], now: datetime) -> datetime | None:
    """The end of the partitions that follow on from the one holding ``now``, without a gap."""
    until = None
    for partition in layout:  # oldest first, never overlapping
        if (until is None and partition.start <= now < partition.end) or partition.start == until:
            until = partition.end
        elif until is not None:
            break
    return until


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
    A partition that reaches ``now`` is never dropped, whatever the retention: rows finishing
    now go there. One that waited for a lock is left for the next pass.
    """
    dropped: dict[str, int] = {}
    with _db.cursor(using) as cur:
        now = _utc(now or _clock(cur))
        for state in TERMINAL_STATES:
            age = max((retentions or {}).get(state) or retention(state), timedelta(0))
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
        cur.execute(
            _UNREADY, {"state": partition.state, "start": partition.start, "end": partition.end}
        )
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
