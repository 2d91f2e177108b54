"""Scale: claim, maintenance, enqueue and drain cost as the jobs table grows.

    .venv/bin/python bench/scale.py [--quick] [--only STATE ...] [--verbose] [--explain]
                                    [--check]

Builds six table states one after the other, each from ``TRUNCATE jobs_job`` with bulk SQL
(``INSERT … SELECT … generate_series``) on the bench database (``<db>_bench``), and measures
in each one:

1. claim: 100 claims of 50 jobs, the worker's statement (``jobs.queue.claim``) for four of
   the state's eight job types, rotating and sharing the 50 slots as the worker does; each
   claim runs in a transaction that is rolled back, so every claim sees the state as built (a
   commit would add one WAL flush, the same in every state). p50 and p99 of the call;
2. maintenance: every pass a worker and the scheduler run on a timer (``MAINTENANCE``: the
   worker's ``recover()`` and ``run_once()``, the scheduler's watchdog and retention, and its
   gauges duty where the app has one), each in a transaction that is rolled back; median and
   max of a whole round over 15 rounds (``--verbose``: each pass and its statements). The
   states hold no expired lease and no finished row past its retention, so what is measured
   is what looking costs, which must not grow with the table;
3. enqueue: ``jobs.enqueue`` one job per transaction (300), then one ``enqueue_many`` of
   10,000 no-op jobs (``bench.noop.v1``);
4. drain: the jobs step 3 enqueued (10,300), drained by 2 worker processes at concurrency 100
   (``drain.py``'s best configuration); jobs/s from the workers' start until a poll saw none
   left, and CPU per job of the workers and of PostgreSQL (as in ``drain.py``). The rows are
   deleted afterwards.

The state rows belong to job types no worker runs (``bench.scale0.v1`` …), so the workers of
step 4 only ever see their own jobs and the state stays as built. The states, in order
(``--only`` takes the name in brackets; the baseline always runs, every ratio is against it):

- ``empty`` [empty];
- ``10 k queued`` [base], the baseline: 10,000 due jobs of eight types, priorities 0 and -5,
  due over the last hour. Every other state but the empty one holds the same due set, so its
  claims find the same work;
- ``1 M queued`` [queued]: 1,000,000 due jobs: the due set and 990,000 more at priorities
  from 10 to -5;
- ``1 M future-dated`` [future]: 1,000,000 jobs due from one hour to three days from now at
  priorities 10 to -5, plus the baseline's due set: in the claim index's order (priority
  first) a claim must get past the future rows of priority 10 and 5 to reach the due ones;
- ``10 M finished`` [finished]: 10,000,000 succeeded (90 %) and failed rows finished over the
  last 23 hours (inside ``SUCCEEDED_RETENTION``), 10 % still holding their job id, plus the
  due set;
- ``right after draining 1 M`` [drained]: the due set and 1,000,000 due no-op jobs, vacuumed,
  then drained by the same 2 workers with autovacuum on; measured as soon as the last job
  has succeeded, with the dead tuples the drain left. During that drain a side connection
  claims 50 rows of the due set (types the workers do not run, rolled back) every 100 ms:
  the "during drain" p50 and p99 of the notes.

Every state but the drained one is vacuumed and analysed after it is built. The table has the
build time of each state and, against the baseline, the ratio of the claim p50 (target
≤ 1.5), of the maintenance median (≤ 2) and of the drain rate (≥ 0.8); a miss is marked
``!``, and ``--check`` exits 1 when there is one. A second table has the table's live and
dead tuples, its autovacuum runs during the state, and the size of the heap and each index.
``--explain`` writes the EXPLAIN (ANALYZE, BUFFERS) of the claim and of every maintenance
statement in every state to ``var/bench/scale-plans.txt``.

``--quick`` divides the state sizes by 100 (the due set by 10) and the enqueue and drain
counts by 10: a smoke run of about half a minute. The full run takes about 8 minutes on a
2-core machine, up to 13 while a test run shares it; more than half of it is the drain of
1 M jobs, and the 10 M finished rows take one to four minutes to build.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from typing import Any

from _common import (
    EVERY_JOB,
    PostgresCpu,
    out_path,
    percentile,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
)

CLAIM_TARGET = 1.5  # claim p50 / baseline, at most
MAINTENANCE_TARGET = 2.0  # maintenance median / baseline, at most
DRAIN_TARGET = 0.8  # drain jobs/s / baseline, at least

#: Job types of the state rows; claims ask for the first four (the others are another
#: service's types, present in the index but never asked for). No worker runs any of them.
STATE_NAMES = [f"bench.scale{i}.v1" for i in range(8)]
CLAIMED_NAMES = STATE_NAMES[:4]
NOOP = "bench.noop.v1"
#: Priorities of the backlog and future rows, and of the due set (lower: see the docstring).
PRIORITIES = [10, 5, 0, 0, 0, -5]
DUE_PRIORITIES = [0, 0, -5]
DRAIN_PROCESSES, DRAIN_CONCURRENCY = 2, 100
CHUNK = 500_000  # rows per INSERT statement while building
BUILDERS = 2  # connections inserting at once while building
PLANS_FILE = "scale-plans.txt"  # under var/bench/, with --explain
PROBE_INTERVAL = 0.1  # seconds between claims of the side connection during the big drain

HOUR, DAY = 3600, 86400


@dataclass(frozen=True)
class Sizes:
    """How big each state and each measurement is (``--quick`` shrinks them)."""

    base: int = 10_000  # the baseline's due rows, also the due set of the other states
    backlog: int = 1_000_000  # queued rows of the 1 M queued and 1 M future-dated states
    finished: int = 10_000_000
    drained: int = 1_000_000
    claims: int = 100
    claim_size: int = 50
    rounds: int = 15  # maintenance rounds
    singles: int = 300
    batch: int = 10_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            base=1_000,
            backlog=10_000,
            finished=100_000,
            drained=10_000,
            rounds=5,
            singles=30,
            batch=1_000,
        )


@dataclass
class Result:
    """What one state measured, and what the table looked like."""

    label: str
    build: float = 0.0
    claims: list[float] = field(default_factory=list)  # seconds per claim
    claimed: int = 0  # fewest jobs one claim returned
    rounds: list[float] = field(default_factory=list)  # seconds per maintenance round
    passes: dict[str, list[float]] = field(default_factory=dict)
    statements: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    single_rate: float = 0.0
    batch_rate: float = 0.0
    drain_rate: float = 0.0
    cpu_per_job: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plans: dict[str, str] = field(default_factory=dict)  # statement → plan, with --explain

    @property
    def claim_p50(self) -> float:
        return percentile(self.claims, 50) * 1000

    @property
    def claim_p99(self) -> float:
        return percentile(self.claims, 99) * 1000

    @property
    def maintenance(self) -> float:
        return statistics.median(self.rounds) * 1000


# -- building the states ----------------------------------------------------------------------

QUEUED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT %(prefix)s || g, (%(names)s::text[])[1 + g %% %(n_names)s], jsonb_build_object('n', g),
       'tenant-' || (g %% 20), 'default',
       (%(priorities)s::int[])[1 + (g / %(n_names)s) %% %(n_priorities)s], %(max_attempts)s,
       statement_timestamp() + make_interval(secs => %(start)s + (g::bigint * 7919) %% %(span)s),
       'queued', 0, '', '', '', TRUE, '', statement_timestamp() - interval '1 hour'
FROM generate_series(%(first)s, %(last)s) AS g
"""

# Finished rows: every tenth still holds its job id (keyed, inside its window) and so stays in
# jobs_job; the rest finished without a key and live in the history table, where the archive
# puts such rows ten seconds after they finish.
FINISHED_ROWS = """
SELECT 'done-' || lpad(g::text, 9, '0'), (%(names)s::text[])[1 + g %% %(n_names)s],
       jsonb_build_object('n', g), 'tenant-' || (g %% 20), 'default', 0, 5,
       f.at - interval '2 seconds',
       CASE WHEN g %% 10 = 0 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN g %% 10 = 0 THEN 5 ELSE 1 END,
       CASE WHEN g %% 10 = 0 THEN 'handler_error' ELSE '' END,
       CASE WHEN g %% 10 = 0 THEN 'ValueError: the benchmark says no' ELSE '' END,
       'bench-host:1', '', f.at - interval '2 seconds',
       f.at - interval '10 ms', f.at - interval '10 ms', f.at,
       CASE WHEN g %% 10 = 0 THEN NULL ELSE to_jsonb(extract(epoch FROM f.at)::float8) END,
       {extra}
FROM generate_series(%(first)s, %(last)s) AS g
CROSS JOIN LATERAL (
    SELECT %(now)s::timestamptz
           - make_interval(secs => %(span)s * (1 - g::float8 / %(count)s)) AS at
) AS f
WHERE {where}
"""
FINISHED_COLUMNS = """job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
    state, attempts, last_error, error_detail, claimed_by, replayed_by, created_at, started_at,
    heartbeat_at, finished_at, result"""
FINISHED_KEYED = f"INSERT INTO jobs_job ({FINISHED_COLUMNS}, key_held, keyed)" + (
    FINISHED_ROWS.format(extra="TRUE, TRUE", where="g %% 10 = 1")
)
FINISHED_ARCHIVED = f"INSERT INTO jobs_jobhistory ({FINISHED_COLUMNS}, keyed, id)" + (
    FINISHED_ROWS.format(
        extra="FALSE, nextval(pg_get_serial_sequence('jobs_job', 'id'))",
        where="g %% 10 <> 1",
    )
)


def chunks(count: int) -> list[tuple[int, int]]:
    """1-based (first, last) ranges of at most CHUNK rows: a 10 M-row build in one statement
    gives no progress and one huge transaction; a chunk each commits on its own."""
    return [(first, min(first + CHUNK - 1, count)) for first in range(1, count + 1, CHUNK)]


def insert_rows(cur: Any, sql: str, params: dict[str, Any], count: int, what: str) -> None:
    """Run ``sql`` once per chunk of ``1..count`` (its ``first`` and ``last`` parameters).

    One chunk runs on ``cur``; more run on BUILDERS connections at once, since a single
    backend inserting keeps only one of the machine's cores busy.
    """
    ranges = chunks(count)
    if len(ranges) == 1:
        cur.execute(sql, {**params, "first": 1, "last": count})
        return
    done = 0
    with ThreadPoolExecutor(BUILDERS) as pool:
        for last in pool.map(
            lambda r: insert_chunk(sql, {**params, "first": r[0], "last": r[1]}), ranges
        ):
            done += last
            print(f"  {done:,} {what} rows", file=sys.stderr)


def insert_chunk(sql: str, params: dict[str, Any]) -> int:
    """One chunk on this thread's own connection (closed after); returns its row count."""
    from django.db import connection

    try:
        with connection.cursor() as cur:
            cur.execute(sql, params)
            return int(cur.rowcount)
    finally:
        connection.close()


def insert_queued(
    cur: Any,
    count: int,
    *,
    prefix: str,
    names: Sequence[str] = STATE_NAMES,
    priorities: Sequence[int] = PRIORITIES,
    due_from: int = -HOUR,
    span: int = HOUR,
    max_attempts: int = 5,
) -> None:
    """Insert ``count`` queued rows due from ``due_from`` seconds from now over ``span``
    seconds, spread over ``names`` and ``priorities`` independently of each other."""
    params = {
        "prefix": prefix,
        "names": list(names),
        "n_names": len(names),
        "priorities": list(priorities),
        "n_priorities": len(priorities),
        "max_attempts": max_attempts,
        "start": due_from,
        "span": span,
    }
    insert_rows(cur, QUEUED, params, count, f"{prefix.rstrip('-')} queued")


def insert_due_set(cur: Any, sizes: Sizes) -> None:
    """The baseline's due rows: what every claim finds, in every state but the empty one."""
    insert_queued(cur, sizes.base, prefix="due-", priorities=DUE_PRIORITIES)


def build_finished(cur: Any, count: int) -> None:
    """Insert ``count`` finished rows (90 % succeeded, 10 % failed) over the last 23 hours.

    They finish in id order, oldest first, as rows do that were enqueued and run in turn (and
    so every index takes them at a few places in order: a build in random order takes several
    times longer). Every tenth still holds its job id.

    The tenth that holds its job id stays in ``jobs_job`` (the idempotency window keeps it
    there); the rest are in the partitioned history table, where the archive moves finished
    rows that hold no key.
    """
    from jobs.queue import history

    cur.execute("SELECT statement_timestamp()")
    (now,) = cur.fetchone()
    params = {
        "names": STATE_NAMES,
        "n_names": len(STATE_NAMES),
        "now": now,
        "count": count,
        "span": 23 * HOUR,
    }
    for state in ("succeeded", "failed"):
        history.ensure(cur, state, now - timedelta(seconds=24 * HOUR), now)
    insert_rows(cur, FINISHED_KEYED, params, count, "finished, keyed")
    insert_rows(cur, FINISHED_ARCHIVED, params, count, "finished, archived")


def build_empty(sizes: Sizes, result: Result) -> None:
    """Nothing at all: what the passes cost with no rows to look at."""
    truncate()
    vacuum_state()


def build_base(sizes: Sizes, result: Result) -> None:
    """The baseline: a small due backlog, the table most deployments have most of the time."""
    truncate()
    with cursor() as cur:
        insert_due_set(cur, sizes)
    vacuum_state()


def build_queued(sizes: Sizes, result: Result) -> None:
    """A large due backlog: more rows in the claim index ahead of and around the claimed ones."""
    truncate()
    with cursor() as cur:
        insert_queued(cur, sizes.backlog - sizes.base, prefix="backlog-")
        insert_due_set(cur, sizes)
    vacuum_state()


def build_future(sizes: Sizes, result: Result) -> None:
    """Scheduled work that is not due: it sits ahead of the due rows in the claim index."""
    truncate()
    with cursor() as cur:
        insert_queued(cur, sizes.backlog, prefix="future-", due_from=HOUR, span=3 * DAY)
        insert_due_set(cur, sizes)
    vacuum_state()


def build_finished_state(sizes: Sizes, result: Result) -> None:
    """History: many finished rows that neither claims nor the passes should have to read."""
    truncate()
    with cursor() as cur:
        build_finished(cur, sizes.finished)
        insert_due_set(cur, sizes)
    vacuum_state()


def build_drained(sizes: Sizes, result: Result) -> None:
    """The table right after a big backlog went through: dead tuples, bloated indexes.

    The backlog is vacuumed before the drain (a table at rest); the drain runs with
    autovacuum on, and nothing cleans up after it before the measurements.
    """
    truncate()
    with cursor() as cur:
        insert_due_set(cur, sizes)
        insert_queued(
            cur, sizes.drained, prefix="drain-", names=[NOOP], priorities=[0], max_attempts=3
        )
    vacuum_state()
    probe = ClaimProbe(sizes)
    started = time.monotonic()
    with probe:
        rate, _ = drain(0, sizes.drained, timeout=3600)
    probed = probe.times
    result.notes.append(
        f"drained {sizes.drained:,} jobs in {time.monotonic() - started:.0f}s ({rate:,.0f} "
        f"jobs/s); claim during the drain: p50 {percentile(probed, 50) * 1000:.2f} ms, "
        f"p99 {percentile(probed, 99) * 1000:.2f} ms ({len(probed):,} claims)"
        if probed
        else f"drained {sizes.drained:,} jobs ({rate:,.0f} jobs/s); no claim during the drain"
    )


@dataclass(frozen=True)
class State:
    """One table state: its ``--only`` name, its row label (from the sizes), its builder."""

    slug: str
    label: Callable[[Sizes], str]
    build: Callable[[Sizes, Result], None]


STATES = [
    State("empty", lambda s: "empty", build_empty),
    State("base", lambda s: f"{count_label(s.base)} queued", build_base),
    State("queued", lambda s: f"{count_label(s.backlog)} queued", build_queued),
    State("future", lambda s: f"{count_label(s.backlog)} future-dated", build_future),
    State("finished", lambda s: f"{count_label(s.finished)} finished", build_finished_state),
    State("drained", lambda s: f"right after draining {count_label(s.drained)}", build_drained),
]
BASELINE = "base"


def count_label(count: int) -> str:
    """10000 → '10 k', 1000000 → '1 M': the state names the issue uses."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count:,}"


@contextmanager
def cursor() -> Iterator[Any]:
    """A cursor on the script's own (autocommit) connection."""
    from django.db import connection

    with connection.cursor() as cur:
        yield cur


# -- 1. claims --------------------------------------------------------------------------------


@cache
def worker_config() -> Any:
    """A worker's configuration with the defaults (base worker scope, lease, identity)."""
    from jobs.worker.config import WorkerConfig

    return WorkerConfig(install_signal_handlers=False, identity="bench-scale")


def claim_requests(turn: int, size: int, names: Sequence[str], cap: int) -> list[Any]:
    """The worker's requests: its types rotated by one each pass, the free slots shared."""
    from jobs.queue import ClaimRequest

    first = turn % len(names)
    share = -(-size // len(names))
    return [ClaimRequest(name, share, cap) for name in [*names[first:], *names[:first]]]


def claim_once(
    turn: int, size: int, names: Sequence[str] = CLAIMED_NAMES, cap: int = 5
) -> tuple[float, int]:
    """One claim of ``size`` jobs in a transaction that is rolled back: (seconds, jobs)."""
    from django.db import transaction

    from jobs import queue

    config = worker_config()
    with transaction.atomic():
        started = time.perf_counter()
        claimed = queue.claim(
            claim_requests(turn, size, names, cap),
            scope=config.scope,
            limit=size,
            lease=config.lease_duration,
            worker=config.identity,
        )
        elapsed = time.perf_counter() - started
        transaction.set_rollback(True)
    return elapsed, len(claimed)


def measure_claims(sizes: Sizes, result: Result) -> None:
    """``sizes.claims`` claims, each of the state as built."""
    got = []
    for turn in range(sizes.claims):
        elapsed, claimed = claim_once(turn, sizes.claim_size)
        result.claims.append(elapsed)
        got.append(claimed)
    result.claimed = min(got)


class ClaimProbe:
    """Claims (rolled back) on a side connection every PROBE_INTERVAL while a drain runs:
    what a claim of other work costs while the table churns, before any vacuum."""

    def __init__(self, sizes: Sizes) -> None:
        self.sizes = sizes
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> ClaimProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise SystemExit(f"the claim probe failed: {self.error!r}")

    def _run(self) -> None:
        from django.db import connection

        try:
            turn = 0
            next_at = time.monotonic()
            while not self._stop.is_set():
                elapsed, _ = claim_once(turn, self.sizes.claim_size)
                self.times.append(elapsed)
                turn += 1
                next_at += PROBE_INTERVAL
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # reported by __exit__, on the main thread
            self.error = exc
        finally:
            connection.close()


# -- 2. maintenance ---------------------------------------------------------------------------


@cache
def worker_maintenance() -> Any:
    """The worker's periodic passes, for the bench registry's types (as a bench worker)."""
    from jobs.catalogue.registry import get_registry
    from jobs.worker.maintenance import WorkerMaintenance

    return WorkerMaintenance(worker_config(), get_registry())


def worker_recover() -> object:
    """Every second in every worker: requeue running jobs whose lease expired."""
    return worker_maintenance().recover()


def worker_run_once() -> object:
    """Every maintenance interval in every worker: fail exhausted jobs (and count the backlog,
    in versions before the scheduler's gauges duty)."""
    return worker_maintenance().run_once()


def scheduler_watchdog() -> object:
    """The scheduler's watchdog: expired leases and exhaustion for all tenants, stale runs."""
    from jobs.catalogue.registry import get_registry
    from jobs.scheduler.watchdog import Watchdog

    return Watchdog(max_attempts=get_registry().max_attempts()).run_once()


def scheduler_retention() -> object:
    """The scheduler's retention: finished rows past their retention, old cron slots."""
    from jobs.scheduler.retention import Retention

    return Retention().run_once()


def scheduler_archive() -> object:
    """The scheduler's archive: finished rows that hold no key, to the history table."""
    from jobs.scheduler.retention import Archive

    return Archive().run_once()


def scheduler_gauges() -> object:
    """The scheduler leader's gauges duty: the backlog count per type and the table's health
    (in versions that have it; the count moved there from the worker's run_once)."""
    from jobs.catalogue.registry import get_registry
    from jobs.scheduler.gauges import Gauges

    return Gauges(get_registry().names()).run_once()


#: The passes run on a timer, in the order of one round. A new pass is one more (name,
#: callable) here.
MAINTENANCE: list[tuple[str, Callable[[], object]]] = [
    ("worker.recover", worker_recover),
    ("worker.run_once", worker_run_once),
    ("scheduler.watchdog", scheduler_watchdog),
    ("scheduler.retention", scheduler_retention),
    ("scheduler.archive", scheduler_archive),
]

#: Passes that only some versions of the app have: (name, module, callable), measured where
#: the module exists.
OPTIONAL_MAINTENANCE: list[tuple[str, str, Callable[[], object]]] = [
    ("scheduler.gauges", "jobs.scheduler.gauges", scheduler_gauges),
]


def add_optional_passes() -> None:
    """Append the optional passes this version of the app has to MAINTENANCE."""
    for name, module, fn in OPTIONAL_MAINTENANCE:
        if importlib.util.find_spec(module) is not None:
            MAINTENANCE.append((name, fn))


class StatementTimer:
    """A Django execute wrapper: seconds per SQL statement, by a short label of its text."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def __call__(self, execute: Callable, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.seconds[statement_label(sql)] += time.perf_counter() - started


def statement_label(sql: str) -> str:
    """The statement's first words, enough to tell the passes' statements apart."""
    words = " ".join(sql.split())
    return words if len(words) <= 72 else words[:71] + "…"


def run_pass(fn: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """One pass in a transaction that is rolled back (the state stays as built): its wall
    time and the time of each of its statements."""
    from django.db import connection, transaction

    timer = StatementTimer()
    with connection.execute_wrapper(timer), transaction.atomic():
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        transaction.set_rollback(True)
    return elapsed, dict(timer.seconds)


def measure_maintenance(sizes: Sizes, result: Result) -> None:
    """``sizes.rounds`` rounds of every pass in MAINTENANCE, after one untimed round (the
    first call of a statement in a session pays for its planning caches)."""
    for _name, fn in MAINTENANCE:
        run_pass(fn)
    for _ in range(sizes.rounds):
        total = 0.0
        for name, fn in MAINTENANCE:
            elapsed, statements = run_pass(fn)
            total += elapsed
            result.passes.setdefault(name, []).append(elapsed)
            for label, seconds in statements.items():
                result.statements.setdefault(name, {}).setdefault(label, []).append(seconds)
        result.rounds.append(total)


class PlanRecorder:
    """A Django execute wrapper that runs each statement under EXPLAIN (ANALYZE, BUFFERS)
    first and keeps the plan, then runs it for real (the caller gets its usual result)."""

    def __init__(self) -> None:
        self.plans: dict[str, str] = {}
        self.tag = ""  # what the caller is running, to tell equal statements apart

    def __call__(self, execute: Callable, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not many and sql.lstrip().split(None, 1)[0].upper() != "EXPLAIN":
            execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params, many, context)
            plan = "\n".join(row[0] for row in context["cursor"].fetchall())
            self.plans.setdefault(f"{self.tag}: {statement_label(sql)}", plan)
        return execute(sql, params, many, context)


def explain(sizes: Sizes, result: Result) -> None:
    """For ``--explain``: the plans of the claim, of the workers' claim of the jobs just
    enqueued (behind whatever dead entries the state has) and of every maintenance
    statement, in this state; each runs twice, in transactions rolled back."""
    from django.db import connection

    recorder = PlanRecorder()
    with connection.execute_wrapper(recorder):
        recorder.tag = "claim"
        claim_once(0, sizes.claim_size)
        recorder.tag = f"drain's claim of {NOOP}"
        claim_once(0, DRAIN_CONCURRENCY, [NOOP], 3)
        for name, fn in MAINTENANCE:
            recorder.tag = name
            run_pass(fn)
    result.plans = recorder.plans


# -- 3. enqueue, 4. drain -----------------------------------------------------------------------


def max_id() -> int:
    with cursor() as cur:
        cur.execute(f"SELECT COALESCE(max(id), 0) FROM {EVERY_JOB}")
        return int(cur.fetchone()[0])


def measure_enqueue(sizes: Sizes, result: Result) -> None:
    """Single enqueues, each its own transaction, then one batch; payloads built beforehand."""
    from django.db import transaction

    import jobs
    from bench.benchapp.jobs import Noop

    singles = [Noop(n=i) for i in range(sizes.singles)]
    batch = [Noop(n=i) for i in range(sizes.batch)]
    started = time.perf_counter()
    for payload in singles:
        with transaction.atomic():
            jobs.enqueue(payload)
    result.single_rate = sizes.singles / (time.perf_counter() - started)
    started = time.perf_counter()
    with transaction.atomic():
        jobs.enqueue_many(batch)
    result.batch_rate = sizes.batch / (time.perf_counter() - started)


#: Two small index probes (the claim index and the running index), whatever the table holds.
LEFT = """
SELECT EXISTS (SELECT 1 FROM jobs_job WHERE state = 'queued' AND name = %(name)s)
    OR EXISTS (SELECT 1 FROM jobs_job WHERE state = 'running' AND name = %(name)s)
"""


def wait_drained(after: int, expected: int, workers: Sequence[Any], timeout: float) -> float:
    """Poll (10 ms) until no no-op job is queued or running; the monotonic time it was seen.

    Fails when a worker exits, at the deadline, or when not all ``expected`` jobs enqueued
    after id ``after`` succeeded.
    """
    deadline = time.monotonic() + timeout
    with cursor() as cur:
        while True:
            cur.execute(LEFT, {"name": NOOP})
            left = cur.fetchone()[0]
            now = time.monotonic()
            if not left:
                break
            for worker in workers:
                if worker.popen.poll() is not None:
                    raise SystemExit(f"worker {worker.popen.pid} exited:\n{worker.tail()}")
            if now > deadline:
                raise SystemExit(f"timed out after {timeout:.0f}s with no-op jobs left")
            time.sleep(0.01)
        cur.execute(
            "SELECT count(*) FROM ("
            " SELECT id, name, state FROM jobs_job UNION ALL"
            " SELECT id, name, state FROM jobs_jobhistory"
            ") AS j WHERE id > %s AND name = %s AND state = 'succeeded'",
            [after, NOOP],
        )
        done = cur.fetchone()[0]
    if done != expected:
        raise SystemExit(
            f"expected {expected:,} succeeded no-op jobs, found {done:,}: is another benchmark "
            "using the bench database at the same time? (they all empty its jobs table)"
        )
    return now


def drain(
    after: int, expected: int, *, timeout: float, pg: PostgresCpu | None = None
) -> tuple[float, float]:
    """Drain the queued no-op jobs with the worker processes: (jobs/s, CPU µs per job)."""
    args = ["--concurrency", str(DRAIN_CONCURRENCY)]
    with running_workers(DRAIN_PROCESSES, args) as workers:
        pg_before = pg.total(exclude_self=True) if pg else 0.0
        started = min(w.started_at for w in workers)
        finished = wait_drained(after, expected, workers, timeout)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg_cpu = pg.total(exclude_self=True) - pg_before if pg else 0.0
    return expected / (finished - started), (worker_cpu + pg_cpu) * 1e6 / expected


def measure_enqueue_and_drain(
    sizes: Sizes, result: Result, pg: PostgresCpu, *, plans: bool = False
) -> None:
    """Enqueue, then drain what was enqueued, then delete it: the next step sees the state.
    With ``plans``, the plans are taken between the two."""
    after = max_id()
    measure_enqueue(sizes, result)
    if plans:
        explain(sizes, result)
    expected = sizes.singles + sizes.batch
    result.drain_rate, result.cpu_per_job = drain(after, expected, timeout=600, pg=pg)
    with cursor() as cur:
        cur.execute("DELETE FROM jobs_job WHERE id > %s AND name = %s", [after, NOOP])
        cur.execute("DELETE FROM jobs_jobhistory WHERE id > %s AND name = %s", [after, NOOP])


# -- table statistics -------------------------------------------------------------------------


def flush_stats() -> None:
    """Send this session's pending table statistics now: PostgreSQL sends them at most once a
    second, and counts that arrive after a VACUUM are added to the live tuples it set."""
    with cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")
        cur.execute("SELECT pg_stat_clear_snapshot()")


def vacuum_state() -> None:
    """VACUUM ANALYZE after a build, as autovacuum would leave a table at rest."""
    flush_stats()
    vacuum()


def table_stats() -> dict[str, Any]:
    """Live and dead tuples, autovacuum runs so far, heap and index sizes of jobs_job."""
    flush_stats()
    with cursor() as cur:
        cur.execute(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count, pg_relation_size(relid) "
            "FROM pg_stat_user_tables WHERE relname = 'jobs_job'"
        )
        live, dead, autovacuums, heap = cur.fetchone()
        cur.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'jobs_job'::regclass ORDER BY c.relname"
        )
        indexes = {name.removeprefix("jobs_job_"): size for name, size in cur.fetchall()}
    return {"live": live, "dead": dead, "autovacuums": autovacuums, "heap": heap, **indexes}


# -- running and reporting --------------------------------------------------------------------


def run_state(state: State, sizes: Sizes, pg: PostgresCpu, *, plans: bool = False) -> Result:
    """Build one state, then measure it: maintenance first (it writes nothing that stays),
    claims, then enqueue and drain (whose rows are deleted after)."""
    result = Result(state.label(sizes))
    print(f"{result.label}: building", file=sys.stderr)
    autovacuums = table_stats()["autovacuums"]
    started = time.monotonic()
    state.build(sizes, result)
    result.build = time.monotonic() - started
    result.stats = table_stats()
    result.stats["autovacuums"] -= autovacuums
    print(f"  built in {result.build:.1f}s; measuring", file=sys.stderr)
    measure_maintenance(sizes, result)
    measure_claims(sizes, result)
    measure_enqueue_and_drain(sizes, result, pg, plans=plans)
    print(
        f"  claim p50 {result.claim_p50:.2f} ms, maintenance {result.maintenance:.1f} ms, "
        f"drain {result.drain_rate:,.0f} jobs/s",
        file=sys.stderr,
    )
    return result


def ratio(
    value: float, base: float, *, at_most: float | None = None, at_least: float = 0.0
) -> tuple[str, bool]:
    """``value / base`` as text, with ``!`` when it misses its target; (text, missed)."""
    if not base:
        return "n/a", False
    r = value / base
    missed = (at_most is not None and r > at_most) or r < at_least
    return f"{r:.2f}{' !' if missed else ''}", missed


def report(results: list[Result], base: Result) -> list[str]:
    """Print the tables and notes; returns the misses."""
    misses: list[str] = []
    rows = []
    for r in results:
        claim, claim_miss = ratio(r.claim_p50, base.claim_p50, at_most=CLAIM_TARGET)
        maint, maint_miss = ratio(r.maintenance, base.maintenance, at_most=MAINTENANCE_TARGET)
        drained, drain_miss = ratio(r.drain_rate, base.drain_rate, at_least=DRAIN_TARGET)
        for missed, what in (
            (claim_miss, f"claim p50 {claim} x baseline (target ≤ {CLAIM_TARGET})"),
            (maint_miss, f"maintenance {maint} x baseline (target ≤ {MAINTENANCE_TARGET})"),
            (drain_miss, f"drain {drained} x baseline (target ≥ {DRAIN_TARGET})"),
        ):
            if missed:
                misses.append(f"{r.label}: {what}")
        rows.append(
            [
                r.label,
                r.build,
                r.claim_p50,
                r.claim_p99,
                claim,
                r.maintenance,
                max(r.rounds) * 1000,
                maint,
                r.single_rate,
                r.batch_rate,
                r.drain_rate,
                drained,
                r.cpu_per_job,
            ]
        )
    print(
        table(
            [
                "state",
                "build s",
                "claim p50 ms",
                "claim p99 ms",
                "claim ratio",
                "maint ms",
                "maint max ms",
                "maint ratio",
                "enqueue 1/txn jobs/s",
                "enqueue batch jobs/s",
                "drain jobs/s",
                "drain ratio",
                "CPU µs/job",
            ],
            rows,
        )
    )
    print()
    print(stats_table(results))
    return misses


def stats_table(results: list[Result]) -> str:
    """The table's tuples and sizes as the measurements found them (MB)."""
    indexes = sorted(
        {key for r in results for key in r.stats} - {"live", "dead", "autovacuums", "heap"}
    )
    rows = [
        [
            r.label,
            r.stats["live"],
            r.stats["dead"],
            r.stats["autovacuums"],
            mb(r.stats["heap"]),
            *(mb(r.stats.get(name, 0)) for name in indexes),
        ]
        for r in results
    ]
    headers = ["jobs_job", "live tuples", "dead tuples", "autovacuums", "heap MB"]
    return table([*headers, *(f"{name} MB" for name in indexes)], rows)


def mb(size: int) -> str:
    return f"{size / 2**20:,.1f}"


def report_notes(results: list[Result], sizes: Sizes, verbose: bool) -> None:
    """What each figure is, the builds' own notes, and with ``verbose`` each pass."""
    print(
        f"\nclaim: {sizes.claims} claims of {sizes.claim_size} (4 types, rolled back); "
        f"maintenance: a round of {', '.join(n for n, _ in MAINTENANCE)}, median and max of "
        f"{sizes.rounds} rounds; enqueue: {sizes.singles} single, 1 batch of {sizes.batch:,}; "
        f"drain: those {sizes.singles + sizes.batch:,} jobs, {DRAIN_PROCESSES} worker "
        f"processes at concurrency {DRAIN_CONCURRENCY}; CPU: workers + PostgreSQL per job"
    )
    for r in results:
        if r.claimed < sizes.claim_size and r.label != "empty":
            r.notes.append(f"a claim returned only {r.claimed} jobs")
        for note in r.notes:
            print(f"{r.label}: {note}")
    if verbose:
        for r in results:
            print(f"\n{r.label}: maintenance passes (median / max ms), statements (median ms)")
            for name, times in r.passes.items():
                print(f"  {name:22} {ms(statistics.median(times))} / {ms(max(times))}")
                for label, seconds in r.statements.get(name, {}).items():
                    print(f"      {ms(statistics.median(seconds))}  {label}")


def write_plans(results: list[Result]) -> None:
    """Every state's plans, one file, for comparing a statement's plan across states."""
    path = out_path(PLANS_FILE)
    with path.open("w") as out:
        for r in results:
            for label, plan in r.plans.items():
                out.write(f"== {r.label}, {label}\n{plan}\n\n")
    print(f"plans: {path}")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.2f}"


def quiet_worker_logs() -> None:
    """The state rows are job types no worker here runs, on purpose: the backlog pass (the
    worker's or the scheduler's) would warn about them at every maintenance round."""
    for name in ("jobs.worker", "jobs.scheduler"):
        logging.getLogger(name).setLevel(logging.ERROR)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[s.slug for s in STATES],
        help=f"these states only (the baseline, {BASELINE}, always runs)",
    )
    parser.add_argument("--verbose", action="store_true", help="each maintenance pass")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument(
        "--explain",
        action="store_true",
        help=f"write EXPLAIN (ANALYZE, BUFFERS) of each statement per state to {PLANS_FILE}",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sizes = Sizes.quick() if args.quick else Sizes()
    wanted = set(args.only or [s.slug for s in STATES]) | {BASELINE}
    setup_bench()
    quiet_worker_logs()
    add_optional_passes()
    pg = PostgresCpu()
    results: dict[str, Result] = {}
    try:
        for state in STATES:
            if state.slug in wanted:
                results[state.slug] = run_state(state, sizes, pg, plans=args.explain)
    finally:
        truncate()
    if args.explain:
        write_plans(list(results.values()))
    misses = report(list(results.values()), results[BASELINE])
    report_notes(list(results.values()), sizes, args.verbose)
    print(
        f"\ntargets against {results[BASELINE].label}: claim p50 ≤ {CLAIM_TARGET}x, "
        f"maintenance ≤ {MAINTENANCE_TARGET}x, drain ≥ {DRAIN_TARGET}x"
    )
    for miss in misses:
        print(f"missed: {miss}")
    failed = report_problems()
    if args.check and misses:
        return 1
    return failed


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
