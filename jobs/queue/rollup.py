"""The console's history: finished attempts per minute, and the backlog sampled per minute.

Job rows are pruned within hours; an operator asking "what happened last week" needs counts
that outlive them. Two small tables keep them (``jobs_rollup``, ``jobs_backlogsample``), and
this module and its two neighbours own every statement on both: this one writes,
:mod:`jobs.queue.rollup_compaction` folds, :mod:`jobs.queue.rollup_reads` reads.

**Writing.** The statement that writes outcomes adds to the rollup in the same statement
(:func:`cte`, over the rows it wrote): one upsert per job type, outcome and error code of the
batch, never one per job, and only for rows the write really changed (a fenced outcome counts
nothing). The upsert is a PL/pgSQL function (``jobs_rollup_add``), so each connection plans
it once instead of with every outcome write. Each writing session adds to its own row
(``shard`` is its backend pid), so workers finishing the same type in the same minute never
wait on each other. A hand-back (an attempt returned untried at shutdown) ran nothing and is
not counted. The worker's own passes are the exception: a writer that counts its attempts
itself passes ``count=False``, adds them up in a :class:`Tally` and writes it with :func:`add`
(jobs.worker.history, once a second), which keeps the per-statement cost off the hot path.

**What a row holds.** Attempts counted per outcome (``succeeded``, ``failed``, ``cancelled``,
``retried``) and error code, the total run and queue-latency seconds, and both as histograms
over :data:`BOUNDS`: 57 buckets a factor √2 wide from 1 ms to 53 hours, so a quantile read
from them is within about ±20 % (:meth:`Distribution.quantile`; above the last bound it is
that bound, a floor). Queue latency is the attempt's start minus the time it became due, as
the claim computes it.

**Compaction** (:func:`jobs.queue.rollup_compaction.compact`, the scheduler's retention
pass): minute rows older than :data:`SHARD_FOLD_AFTER` are folded into one row per minute
(shard 0); minute rows older than :data:`MINUTES_KEPT` into hour rows; hour rows are deleted
after ``ROLLUP_RETENTION``. A read adds up whatever rows exist, so every stage of folding gives
the same answers.

**Backlog.** The scheduler's gauges duty, which counts the backlog anyway, records one sample
per type and minute (:func:`record_backlog`); compaction keeps each hour's largest.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.queue import _db
from jobs.queue.types import Outcome

#: Upper bounds (seconds) of the histogram buckets; bucket ``i`` holds values in
#: ``[BOUNDS[i-1], BOUNDS[i])``, bucket 0 values below 1 ms, the last values from ~53 hours.
BOUNDS: tuple[float, ...] = tuple(0.001 * 2 ** (k / 2) for k in range(56))
BUCKETS = len(BOUNDS) + 1

#: Minute rows this old are folded into one row per minute (every shard into shard 0).
SHARD_FOLD_AFTER = timedelta(minutes=2)
#: Minute rows this old are folded into hour rows. Charts with minute bins reach this far back.
MINUTES_KEPT = timedelta(hours=2)
MINUTE = 60
HOUR = 3600


@dataclass(frozen=True, slots=True)
class Distribution:
    """A histogram over :data:`BOUNDS`: how many values fell in each bucket."""

    counts: tuple[int, ...] = (0,) * BUCKETS

    @property
    def n(self) -> int:
        return sum(self.counts)

    def __add__(self, other: Distribution) -> Distribution:
        return Distribution(tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q ≤ 1) in seconds, interpolated within its bucket; None if
        empty. Geometric interpolation in a √2-wide bucket is off by at most about 20 %."""
        if not 0 < q <= 1:
            raise ValueError(f"a quantile is in (0, 1], got {q!r}")
        total = self.n
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.counts):
            if count and seen + count >= rank:
                share = (rank - seen) / count
                if index == 0:
                    return BOUNDS[0] * share
                low = BOUNDS[index - 1]
                if index == len(BOUNDS):  # the open last bucket: its lower bound, a floor
                    return low
                return low * math.pow(BOUNDS[index] / low, share)
            seen += count
        return BOUNDS[-1]  # pragma: no cover - the loop always returns for total > 0

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        """The histogram of ``values`` (seconds), bucketed as PostgreSQL's width_bucket does."""
        counts = [0] * BUCKETS
        for value in values:
            counts[bisect.bisect_right(BOUNDS, value)] += 1
        return cls(tuple(counts))


@dataclass(frozen=True, slots=True)
class Bin:
    """Attempts of one job type, outcome and error code that ended in one time bin."""

    start: datetime
    name: str
    outcome: str
    code: str
    count: int
    run_seconds: float  # total
    wait_seconds: float  # total
    run: Distribution = field(default_factory=Distribution)
    wait: Distribution = field(default_factory=Distribution)


@dataclass(frozen=True, slots=True)
class BacklogPoint:
    """The largest backlog of one job type sampled in one time bin."""

    start: datetime
    name: str
    queued: int
    due: int
    oldest_due_seconds: float | None


# --- writing ---------------------------------------------------------------------------------


# Adding into an existing row: counts and totals summed, histograms bucket by bucket
# (jobs_histogram_add, jobs/queue/sql/functions/).
MERGE = """
ON CONFLICT (period, width, name, outcome, code, shard) DO UPDATE SET
    count = r.count + EXCLUDED.count,
    run_seconds = r.run_seconds + EXCLUDED.run_seconds,
    wait_seconds = r.wait_seconds + EXCLUDED.wait_seconds,
    run_histogram = jobs_histogram_add(r.run_histogram, EXCLUDED.run_histogram),
    wait_histogram = jobs_histogram_add(r.wait_histogram, EXCLUDED.wait_histogram)"""

COLUMNS = (
    "period, width, name, outcome, code, shard, count, run_seconds, wait_seconds, "
    "run_histogram, wait_histogram"
)


def cte(ended: str, *, name: str = "rolled") -> str:
    """A CTE that adds the attempts ``ended`` selects to this minute's rollup rows.

    ``ended`` is a SELECT of ``(name, outcome, code, ran, waited)``: job type, one of
    :class:`~jobs.models.RollupOutcome`'s values, error code ("" for none), run seconds and
    queue-latency seconds (NULL where the attempt never ran). The work is done by the
    ``jobs_rollup_add`` function (jobs/queue/sql/functions/), whose plan each connection
    caches: the statement around it plans only an aggregate and a call. The CTE is a SELECT, so the
    statement must read it for it to run: put :func:`reads` in its final query.
    """
    return f"""
{name} AS (
    SELECT jobs_rollup_add(array_agg(e.name), array_agg(e.outcome), array_agg(e.code),
                           array_agg(e.ran), array_agg(e.waited)) AS added
    FROM ({ended}) AS e(name, outcome, code, ran, waited)
    HAVING count(*) > 0
)"""


def reads(name: str = "rolled") -> str:
    """A condition that holds always and makes the statement run the CTE :func:`cte` names."""
    return f"(SELECT count(*) FROM {name}) >= 0"


#: An attempt as the rollup counts it: job type, outcome, error code, run and wait seconds.
Ended = tuple[str, str, str, float | None, float | None]


def ended(name: str, sent: Outcome, written: Outcome, *, ran: float, waited: float) -> Ended | None:
    """What the rollup counts for an outcome a caller wrote with ``count=False`` (None: a
    hand-back, which ran nothing), as the outcome statement's own count would.

    ``written`` is the outcome as the row got it (:meth:`OutcomeReport.as_written`).
    """
    handed_back = sent.attempts_delta < 0
    if written.state == "queued":
        if handed_back:
            return None
        return (name, "retried", written.code or "", max(0.0, ran), max(0.0, waited))
    code = "" if written.state == "succeeded" else written.code or ""
    return (name, written.state, code, None if handed_back else max(0.0, ran), max(0.0, waited))


class Tally:
    """Attempts counted by their writer, added up per type, outcome and code (in memory).

    The worker keeps one (jobs.worker.history) and writes it with :func:`add` about once a
    second: its size is the number of groups, whatever the number of attempts.
    """

    def __init__(self) -> None:
        # (name, outcome, code) -> [count, run seconds, wait seconds, run and wait buckets]
        self.groups: dict[tuple[str, str, str], list[Any]] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, item: Ended) -> None:
        name, outcome, code, ran, waited = item
        key = (name, outcome, code[:32])
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = [0, 0.0, 0.0, [0] * BUCKETS, [0] * BUCKETS]
        group[0] += 1
        if ran is not None:
            group[1] += ran
            group[3][bisect.bisect_right(BOUNDS, ran)] += 1
        if waited is not None:
            group[2] += waited
            group[4][bisect.bisect_right(BOUNDS, waited)] += 1

    @property
    def attempts(self) -> int:
        return sum(group[0] for group in self.groups.values())


# One row per group, its histograms sliced from two flat arrays.
_ADD_TALLY = f"""
INSERT INTO jobs_rollup AS r ({COLUMNS})
SELECT date_trunc('minute', statement_timestamp(), 'UTC'), {MINUTE}, g.name, g.outcome, g.code,
       pg_backend_pid(), g.n, g.ran, g.waited,
       (%(run)b::int[])[(g.i - 1) * {BUCKETS} + 1 : g.i * {BUCKETS}],
       (%(wait)b::int[])[(g.i - 1) * {BUCKETS} + 1 : g.i * {BUCKETS}]
FROM unnest(%(names)b::text[], %(outcomes)b::text[], %(codes)b::text[], %(counts)b::bigint[],
            %(ran)b::float8[], %(waited)b::float8[])
     WITH ORDINALITY AS g(name, outcome, code, n, ran, waited, i)
{MERGE}
"""


def add(tally: Tally, *, using: str = DEFAULT_DB_ALIAS) -> int:
    """Add a writer's :class:`Tally` to this minute's rollup rows, in one statement."""
    if not tally:
        return 0
    keys = list(tally.groups)
    groups = [tally.groups[key] for key in keys]
    with _db.bound_cursor(using) as cur:
        cur.execute(
            _ADD_TALLY,
            {
                "names": [key[0] for key in keys],
                "outcomes": [key[1] for key in keys],
                "codes": [key[2] for key in keys],
                "counts": [group[0] for group in groups],
                "ran": [group[1] for group in groups],
                "waited": [group[2] for group in groups],
                "run": [count for group in groups for count in group[3]],
                "wait": [count for group in groups for count in group[4]],
            },
        )
        return int(cur.rowcount)


def record_backlog(
    rows: Iterable[tuple[str, int, int, float | None]],
    *,
    at: datetime,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Record ``(name, queued, due, oldest_due_seconds)`` samples for the minute of ``at``.

    A later sample in the same minute replaces an earlier one. Returns the rows written.
    """
    rows = list(rows)
    if not rows:
        return 0
    names, queued, due, oldest = (list(column) for column in zip(*rows, strict=True))
    with connections[using].cursor() as cur:
        cur.execute(
            f"""
            INSERT INTO jobs_backlogsample (period, width, name, queued, due, oldest_due_seconds)
            SELECT date_trunc('minute', %(at)s::timestamptz, 'UTC'), {MINUTE}, s.name, s.queued,
                   s.due, s.oldest
            FROM unnest(%(names)s::text[], %(queued)s::bigint[], %(due)s::bigint[],
                        %(oldest)s::float8[]) AS s(name, queued, due, oldest)
            ON CONFLICT (period, width, name) DO UPDATE SET
                queued = EXCLUDED.queued, due = EXCLUDED.due,
                oldest_due_seconds = EXCLUDED.oldest_due_seconds
            """,
            {"at": at, "names": names, "queued": queued, "due": due, "oldest": oldest},
        )
        return int(cur.rowcount)
