"""Compaction of the console's history: minute rows folded, hour rows expired, in bounded steps.

Minute rows older than :data:`~jobs.queue.rollup.SHARD_FOLD_AFTER` are folded into one row per
minute (shard 0); minute rows older than :data:`~jobs.queue.rollup.MINUTES_KEPT` into hour
rows, and the backlog samples into each hour's largest; hour rows are deleted after
``ROLLUP_RETENTION``. A read adds up whatever rows exist, so every stage of folding gives the
same answers. The scheduler's retention pass runs it (:func:`compact`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.core.conf import jobs_settings
from jobs.queue.rollup import COLUMNS, HOUR, MERGE, MINUTE, MINUTES_KEPT, SHARD_FOLD_AFTER


def compact(
    now: datetime,
    *,
    retention: timedelta | None = None,
    batch_size: int = 5000,
    max_batches: int = 10,
    using: str = DEFAULT_DB_ALIAS,
) -> Counter[str]:
    """Fold old minute rows and delete expired hour rows, in bounded batches.

    Each batch is one statement (it deletes the rows it folds and adds them to their target
    row, atomically), run in autocommit. Returns the rows handled per step.
    """
    retention = jobs_settings.ROLLUP_RETENTION if retention is None else retention
    done: Counter[str] = Counter()
    steps: tuple[tuple[str, Callable[[], int]], ...] = (
        ("shards", lambda: _fold_shards(now - SHARD_FOLD_AFTER, batch_size, using)),
        ("hours", lambda: _fold_hours(now - MINUTES_KEPT, batch_size, using)),
        ("backlog hours", lambda: _fold_backlog(now - MINUTES_KEPT, batch_size, using)),
        ("expired", lambda: _expire(now - retention, batch_size, using)),
    )
    for step, run in steps:
        for _batch in range(max_batches):
            moved = run()
            done[step] += moved
            if moved < batch_size:
                break
    return done


def _fold(
    where: str, period: str, width: int, limit: int, params: dict[str, Any], using: str
) -> int:
    """Move the rollup rows ``where`` selects (at most ``limit``) into shard-0 rows of
    ``width``, whose period is the SQL expression ``period`` over the moved row ``m``."""
    sql = f"""
    WITH moved AS (
        DELETE FROM jobs_rollup AS d
        WHERE (d.period, d.width, d.name, d.outcome, d.code, d.shard) IN (
            SELECT period, width, name, outcome, code, shard FROM jobs_rollup
            WHERE {where} LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        )
        RETURNING d.*
    ),
    buckets AS (
        SELECT {period} AS period, m.name, m.outcome, m.code, u.i,
               sum(u.ran)::int AS ran, sum(u.waited)::int AS waited
        FROM moved AS m,
             unnest(m.run_histogram, m.wait_histogram) WITH ORDINALITY AS u(ran, waited, i)
        GROUP BY 1, 2, 3, 4, 5
    ),
    histograms AS (
        SELECT period, name, outcome, code,
               array_agg(ran ORDER BY i) AS ran, array_agg(waited ORDER BY i) AS waited
        FROM buckets GROUP BY 1, 2, 3, 4
    ),
    totals AS (
        SELECT {period} AS period, m.name, m.outcome, m.code, sum(m.count) AS n,
               sum(m.run_seconds) AS ran, sum(m.wait_seconds) AS waited, count(*) AS moved
        FROM moved AS m GROUP BY 1, 2, 3, 4
    ),
    added AS (
        INSERT INTO jobs_rollup AS r ({COLUMNS})
        SELECT t.period, {width}, t.name, t.outcome, t.code, 0, t.n, t.ran, t.waited,
               h.ran, h.waited
        FROM totals AS t JOIN histograms AS h USING (period, name, outcome, code)
        {MERGE}
    )
    SELECT COALESCE(sum(moved), 0) FROM totals
    """
    with connections[using].cursor() as cur:
        cur.execute(sql, {**params, "limit": limit})
        (moved,) = cur.fetchone()
    return int(moved)


def _fold_shards(before: datetime, limit: int, using: str) -> int:
    return _fold(
        f"width = {MINUTE} AND shard <> 0 AND period < %(before)s",
        "m.period",
        MINUTE,
        limit,
        {"before": before},
        using,
    )


def _fold_hours(before: datetime, limit: int, using: str) -> int:
    return _fold(
        f"width = {MINUTE} AND period < %(before)s",
        "date_trunc('hour', m.period, 'UTC')",
        HOUR,
        limit,
        {"before": before},
        using,
    )


def _fold_backlog(before: datetime, limit: int, using: str) -> int:
    sql = f"""
    WITH moved AS (
        DELETE FROM jobs_backlogsample AS d
        WHERE (d.period, d.width, d.name) IN (
            SELECT period, width, name FROM jobs_backlogsample
            WHERE width = {MINUTE} AND period < %(before)s LIMIT %(limit)s
            FOR UPDATE SKIP LOCKED
        )
        RETURNING d.*
    ),
    added AS (
        INSERT INTO jobs_backlogsample AS s (period, width, name, queued, due, oldest_due_seconds)
        SELECT date_trunc('hour', period, 'UTC'), {HOUR}, name, max(queued), max(due),
               max(oldest_due_seconds)
        FROM moved GROUP BY 1, 3
        ON CONFLICT (period, width, name) DO UPDATE SET
            queued = GREATEST(s.queued, EXCLUDED.queued),
            due = GREATEST(s.due, EXCLUDED.due),
            oldest_due_seconds = GREATEST(s.oldest_due_seconds, EXCLUDED.oldest_due_seconds)
    )
    SELECT count(*) FROM moved
    """
    with connections[using].cursor() as cur:
        cur.execute(sql, {"before": before, "limit": limit})
        (moved,) = cur.fetchone()
    return int(moved)


def _expire(before: datetime, limit: int, using: str) -> int:
    deleted = 0
    with connections[using].cursor() as cur:
        for table, key in (
            ("jobs_rollup", "period, width, name, outcome, code, shard"),
            ("jobs_backlogsample", "period, width, name"),
        ):
            cur.execute(
                f"DELETE FROM {table} WHERE ({key}) IN ("
                f"SELECT {key} FROM {table} WHERE period < %(before)s LIMIT %(limit)s)",
                {"before": before, "limit": limit},
            )
            deleted += cur.rowcount
    return deleted
