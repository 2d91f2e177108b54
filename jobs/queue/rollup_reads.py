"""Reading the console's history: attempts and backlog samples in time bins, for its charts.

A read adds up whatever rollup rows fall in each bin (minute rows, hour rows, any shard), so it
gives the same answers at every stage of compaction (:mod:`jobs.queue.rollup_compaction`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.queue.rollup import MINUTE, BacklogPoint, Bin, Distribution


def bins(
    since: datetime,
    until: datetime,
    step: timedelta,
    *,
    names: Collection[str] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[Bin]:
    """Attempts that ended in ``[since, until)``, per bin of ``step`` (aligned to the epoch,
    UTC), job type, outcome and error code; only non-empty groups, in time order.

    Rows are whole periods: a minute row belongs to the bin its minute starts in, an hour row
    (data older than :data:`MINUTES_KEPT`) to the bin its hour starts in, so bins finer than
    an hour show hour rows in their first bin. ``names`` limits the job types read.
    """
    where, params = _window(since, until, step, names)
    sql = f"""
    WITH rows AS (
        SELECT to_timestamp(floor(extract(epoch FROM period) / %(step)s) * %(step)s) AS start,
               name, outcome, code, count, run_seconds, wait_seconds,
               run_histogram, wait_histogram
        FROM jobs_rollup WHERE {where}
    ),
    buckets AS (
        SELECT start, name, outcome, code, u.i, sum(u.ran)::int AS ran,
               sum(u.waited)::int AS waited
        FROM rows, unnest(run_histogram, wait_histogram) WITH ORDINALITY AS u(ran, waited, i)
        GROUP BY 1, 2, 3, 4, 5
    ),
    histograms AS (
        SELECT start, name, outcome, code,
               array_agg(ran ORDER BY i) AS ran, array_agg(waited ORDER BY i) AS waited
        FROM buckets GROUP BY 1, 2, 3, 4
    )
    SELECT t.start, t.name, t.outcome, t.code, t.n, t.ran, t.waited, h.ran, h.waited
    FROM (
        SELECT start, name, outcome, code, sum(count) AS n, sum(run_seconds) AS ran,
               sum(wait_seconds) AS waited
        FROM rows GROUP BY 1, 2, 3, 4
    ) AS t JOIN histograms AS h USING (start, name, outcome, code)
    ORDER BY t.start, t.name, t.outcome, t.code
    """
    with connections[using].cursor() as cur:
        cur.execute(sql, params)
        found = cur.fetchall()
    return [
        Bin(
            start=start,
            name=name,
            outcome=outcome,
            code=code,
            count=int(n),
            run_seconds=float(ran),
            wait_seconds=float(waited),
            run=Distribution(tuple(ran_hist)),
            wait=Distribution(tuple(wait_hist)),
        )
        for start, name, outcome, code, n, ran, waited, ran_hist, wait_hist in found
    ]


def backlog_points(
    since: datetime,
    until: datetime,
    step: timedelta,
    *,
    names: Collection[str] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[BacklogPoint]:
    """The largest sampled backlog per bin of ``step`` and job type in ``[since, until)``."""
    where, params = _window(since, until, step, names)
    with connections[using].cursor() as cur:
        cur.execute(
            f"""
            SELECT to_timestamp(floor(extract(epoch FROM period) / %(step)s) * %(step)s),
                   name, max(queued), max(due), max(oldest_due_seconds)
            FROM jobs_backlogsample WHERE {where}
            GROUP BY 1, 2 ORDER BY 1, 2
            """,
            params,
        )
        found = cur.fetchall()
    return [
        BacklogPoint(start, name, int(queued), int(due), oldest)
        for start, name, queued, due, oldest in found
    ]


def _window(
    since: datetime, until: datetime, step: timedelta, names: Collection[str] | None
) -> tuple[str, dict[str, Any]]:
    """The WHERE clause and parameters of a read: periods in ``[since, until)``, bins of
    ``step`` (``%(step)s`` seconds), and the job types asked for."""
    where = "period >= %(since)s AND period < %(until)s"
    params: dict[str, Any] = {"since": since, "until": until, "step": _step_seconds(step)}
    if names is not None:
        where += " AND name = ANY(%(names)s::text[])"
        params["names"] = list(names)
    return where, params


def _step_seconds(step: timedelta) -> int:
    seconds = step.total_seconds()
    if seconds < MINUTE or seconds % MINUTE:
        raise ValueError(f"a bin is a whole number of minutes, got {step}")
    return int(seconds)


def summed(items: Sequence[Bin]) -> Bin | None:
    """All of ``items`` as one bin (the first one's start, name, outcome and code)."""
    if not items:
        return None
    first = items[0]
    run = Distribution()
    wait = Distribution()
    for item in items:
        run += item.run
        wait += item.wait
    return Bin(
        start=first.start,
        name=first.name,
        outcome=first.outcome,
        code=first.code,
        count=sum(item.count for item in items),
        run_seconds=sum(item.run_seconds for item in items),
        wait_seconds=sum(item.wait_seconds for item in items),
        run=run,
        wait=wait,
    )
