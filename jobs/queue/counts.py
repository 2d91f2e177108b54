"""Counting jobs in both their homes, the jobs table and the history, for the console.

A finished job is counted where it is (:data:`HOMES`), never in both. Every count stops after
:data:`COUNT_CAP` rows of one index or one state's partitions; past it a count is PostgreSQL's
estimate, or a floor ("at least"), so the console's overview costs the same however many rows
the tables hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.backends.utils import CursorWrapper

from jobs.queue import _db
from jobs.queue.history import PARENT
from jobs.runs import TERMINAL_STATES


def estimated_rows(*, using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    """Rows of the history per state, from PostgreSQL's statistics (no table is read).

    A partition not analysed yet counts by its size in pages (as the planner would); figures
    are as fresh as autovacuum's last ANALYZE of each partition.
    """
    with _db.cursor(using) as cur:
        cur.execute(
            """
            SELECT parent.relname, sum(CASE WHEN c.reltuples >= 0 THEN c.reltuples
                                            ELSE c.relpages * 50 END)::bigint
            FROM pg_inherits i
            JOIN pg_class parent ON parent.oid = i.inhparent
            JOIN pg_class c ON c.oid = i.inhrelid
            WHERE parent.relname = ANY(%s)
            GROUP BY parent.relname
            """,
            [[f"{PARENT}_{state}" for state in TERMINAL_STATES]],
        )
        found = dict(cur.fetchall())
    return {
        state: int(found.get(f"{PARENT}_{state}") or 0)
        for state in TERMINAL_STATES
        if found.get(f"{PARENT}_{state}")
    }


#: Where a job's row is: the jobs table (active, or finished and holding its key) or the history.
HOMES = ("jobs", "history")
#: The tables of :data:`HOMES`.
TABLES = {"jobs": "jobs_job", "history": PARENT}
#: Counts of rows stop here, as the admin's lists' do: past it a count is PostgreSQL's estimate.
COUNT_CAP = 10_000


@dataclass(frozen=True)
class Counted:
    """A count of rows: exact, PostgreSQL's estimate, or (``floor``) at least ``n``."""

    n: int
    estimate: bool = False
    floor: bool = False

    @property
    def exact(self) -> bool:
        return not (self.estimate or self.floor)

    def __add__(self, other: Counted) -> Counted:
        return Counted(self.n + other.n, self.estimate or other.estimate, self.floor or other.floor)


# Rows per home and state, each count stopping at cap + 1 rows. The states are literals so
# that each count reads one index (the jobs table's partial indexes on running and finished
# rows) or one state's partitions of the history, and stops there: no count reads more than
# cap + 1 entries, whatever the tables hold.
_STATES = """
SELECT (SELECT count(*) FROM (SELECT FROM jobs_job WHERE state = 'running'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_job WHERE state = 'succeeded'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_job WHERE state = 'failed'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_job WHERE state = 'cancelled'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_jobhistory WHERE state = 'succeeded'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_jobhistory WHERE state = 'failed'
                              LIMIT %(over)s) AS c),
       (SELECT count(*) FROM (SELECT FROM jobs_jobhistory WHERE state = 'cancelled'
                              LIMIT %(over)s) AS c)
"""
_COUNTED = (
    ("jobs", "running"),
    ("jobs", "succeeded"),
    ("jobs", "failed"),
    ("jobs", "cancelled"),
    ("history", "succeeded"),
    ("history", "failed"),
    ("history", "cancelled"),
)

# Failed rows per job type in each home, over at most cap + 1 rows of each. No order: an
# ORDER BY would let the planner sort a small history whole rather than stop at the limit.
_FAILED_BY_TYPE = """
SELECT 'jobs', name, count(*)
FROM (SELECT name FROM jobs_job WHERE state = 'failed' LIMIT %(over)s) AS j
GROUP BY name
UNION ALL
SELECT 'history', name, count(*)
FROM (SELECT name FROM jobs_jobhistory WHERE state = 'failed' LIMIT %(over)s) AS h
GROUP BY name
"""

_ESTIMATE_JOBS = "EXPLAIN (FORMAT JSON) SELECT 1 FROM jobs_job WHERE state = %s"


def state_counts(
    *, cap: int = COUNT_CAP, using: str = DEFAULT_DB_ALIAS
) -> dict[tuple[str, str], Counted]:
    """Running and finished rows per ``(home, state)``, each exact up to ``cap``.

    A finished job is counted where it is, the jobs table or the history (never both), so
    the two add up to every finished row kept. Past ``cap`` a count is PostgreSQL's estimate
    (the planner's for the jobs table, the partitions' statistics for the history), or
    "more than ``cap``" while the estimate says less. Queued rows are
    :func:`jobs.queue.backlog`'s to count. One statement, plus one look at the statistics
    per count past the cap.
    """
    with _db.cursor(using) as cur:
        cur.execute(*state_counts_sql(cap=cap))
        found = dict(zip(_COUNTED, cur.fetchone(), strict=True))
        over = [key for key, n in found.items() if n > cap]
        estimates = _estimates(cur, over, using)
    return {
        key: Counted(n) if n <= cap else _past(cap, estimates.get(key, 0))
        for key, n in found.items()
    }


@dataclass(frozen=True)
class FailedByType:
    """Failed rows per job type and home, and the homes whose counts stopped at the cap."""

    counts: dict[str, dict[str, Counted]]
    capped: frozenset[str]

    def of(self, name: str) -> dict[str, Counted]:
        """A type's counts per home; in a capped home a type not read counts "0+"."""
        found = dict(self.counts.get(name, {}))
        for home in self.capped:
            found.setdefault(home, Counted(0, floor=True))
        return found


def failed_by_type(*, cap: int = COUNT_CAP, using: str = DEFAULT_DB_ALIAS) -> FailedByType:
    """Failed rows per job type and home: exact while a home holds at most ``cap`` of them.

    Past that the home's counts are read over ``cap + 1`` of its failed rows and are floors:
    "at least". Cost: at most ``cap + 1`` rows per home.
    """
    with _db.cursor(using) as cur:
        cur.execute(*failed_by_type_sql(cap=cap))
        found = cur.fetchall()
    read = {home: sum(n for where, _name, n in found if where == home) for home in HOMES}
    capped = frozenset(home for home in HOMES if read[home] > cap)
    counts: dict[str, dict[str, Counted]] = {}
    for home, name, n in found:
        counts.setdefault(name, {})[home] = Counted(n, floor=home in capped)
    return FailedByType(counts, capped)


def state_counts_sql(*, cap: int = COUNT_CAP) -> tuple[str, dict[str, Any]]:
    """:func:`state_counts`' statement and its parameters (also used for EXPLAIN)."""
    return _STATES, {"over": _over(cap)}


def failed_by_type_sql(*, cap: int = COUNT_CAP) -> tuple[str, dict[str, Any]]:
    """:func:`failed_by_type`'s statement and its parameters (also used for EXPLAIN)."""
    return _FAILED_BY_TYPE, {"over": _over(cap)}


def _over(cap: int) -> int:
    if cap < 1:
        raise ValueError(f"a count's cap must be at least 1, got {cap}")
    return cap + 1


def _estimates(
    cur: CursorWrapper, keys: list[tuple[str, str]], using: str
) -> dict[tuple[str, str], int]:
    """PostgreSQL's row estimates for these ``(home, state)`` counts (no table is read)."""
    estimates: dict[tuple[str, str], int] = {}
    archived = estimated_rows(using=using) if any(h == "history" for h, _s in keys) else {}
    for home, state in keys:
        if home == "history":
            estimates[home, state] = archived.get(state, 0)
        else:
            cur.execute(_ESTIMATE_JOBS, [state])
            [plan] = _db.load_json(cur.fetchone()[0])
            estimates[home, state] = int(plan["Plan"]["Plan Rows"])
    return estimates


def _past(cap: int, estimate: int) -> Counted:
    """A count that stopped past ``cap``: the estimate if it says more, else "more than cap"."""
    return Counted(estimate, estimate=True) if estimate > cap else Counted(cap, floor=True)
