"""Flow control across the fleet: a global concurrency limit and a rate limit, held.

    .venv/bin/python bench/flow.py [--part gate rate] [--limit 10] [--rate 50] [--seconds 60]
    .venv/bin/python bench/flow.py --gated-jobs 1000 --seconds 10     # smoke run, about 30 s

Two measurements, each from an empty bench table with the jobs queued before any worker runs:

**gate**: ``--gated-jobs`` jobs (default 5,000) of ``bench.gated.v1``, whose type has
``global_concurrency=--limit`` (default 10), drained by ``--gate-processes`` workers (default
4) of ``--concurrency`` threads (default 50): far more slots than the limit. Each handler
counts itself in a table (``bench_flow_gauge``) on entry and out on exit, each an autocommit
statement of its own (``SET cur = cur + 1, peak = GREATEST(peak, cur + 1)``), and waits
``--ms`` (default 20 ms) in between. Prints the peak of handlers inside at once (the gauge's)
and whether it ever exceeded the limit (target: never); for comparison, the most jobs whose
``started_at``..``finished_at`` overlap (the claim statement's start to the outcome
statement's, PostgreSQL's clock: the engine's own view of running, which can read one or
two high when a claim waited for the type's gate after its statement started); the mean
handlers inside and the mean jobs of the type in state running (claimed, outcome not yet
written: what the gate counts; this script samples both every 20 ms), the drain rate against
the ideal (limit / wait), and CPU µs per job of the workers and PostgreSQL (as bench/drain.py
measures it).

**rate**: ``bench.rated.v1`` (no-op handler, ``rate_limit=Rate(--rate, per=1)``, default 50
a second; its bucket holds ``Rate.capacity``, 100 ms worth), with twice the jobs the window
needs queued, run by ``--rate-processes`` workers (default 2) of ``--concurrency`` threads.
After ``--warmup`` seconds (default 3) a window of ``--seconds`` (default 60) starts and ends
on PostgreSQL's clock; the jobs whose ``started_at`` falls in it are counted. Prints the
observed rate and its deviation from the limit (target within 5 %), the most starts in any
1 s (a sliding window over the starts: at most the rate plus the bucket's capacity when the
bucket works), the fewest and most in the window's whole seconds, the longest gap between
two starts and the seconds the bucket sat full (the gaps' time beyond what fills the bucket:
starts lost for good, about the rate times that), and the CPU the throttled workers and
PostgreSQL spent over the window, per job and in cores.

The limits reach the workers through the environment (``BENCH_GLOBAL_CONCURRENCY``,
``BENCH_RATE``, read by bench/benchapp/jobs.py). With ``--check``, exits 1 if the gate was
ever exceeded or the rate is off by more than 5 %.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

from _common import (
    EVERY_JOB,
    UNFINISHED,
    PostgresCpu,
    counts,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
)

RATE_TOLERANCE = 0.05  # of the limit


def enqueue(payload: type, count: int, **fields: int) -> None:
    import jobs

    for first in range(0, count, 1000):
        batch = range(first, min(first + 1000, count))
        jobs.enqueue_many([payload(n=i, **fields) for i in batch])


def reset_gauge(name: str) -> None:
    from django.db import connection

    from bench.benchapp.jobs import GAUGE_TABLE

    with connection.cursor() as cur:
        cur.execute(
            f"CREATE TABLE IF NOT EXISTS {GAUGE_TABLE} "
            "(name text PRIMARY KEY, cur integer NOT NULL, peak integer NOT NULL)"
        )
        cur.execute(
            f"INSERT INTO {GAUGE_TABLE} VALUES (%s, 0, 0) "
            "ON CONFLICT (name) DO UPDATE SET cur = 0, peak = 0",
            [name],
        )


def overlap_peak(name: str) -> int:
    """The most jobs of ``name`` whose ``started_at``..``finished_at`` overlap (an end
    before a start at the same instant)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT coalesce(max(inside), 0) FROM (SELECT sum(step) OVER (ORDER BY at, step "
            "ROWS UNBOUNDED PRECEDING) AS inside FROM (SELECT started_at AS at, 1 AS step "
            f"FROM {EVERY_JOB} WHERE name = %s UNION ALL SELECT finished_at, -1 FROM {EVERY_JOB} "
            "WHERE name = %s) AS steps) AS running",
            [name, name],
        )
        return int(cur.fetchone()[0])


def gate(args: argparse.Namespace, pg: PostgresCpu) -> tuple[list[object], bool]:
    from django.db import connection

    from bench.benchapp.jobs import GAUGE_TABLE, Gated

    name = Gated.job_name
    truncate()
    reset_gauge(name)
    enqueue(Gated, args.gated_jobs, ms=args.ms)
    vacuum()
    samples: list[int] = []  # handlers inside (the gauge)
    running: list[int] = []  # jobs of the type running (claimed, outcome not yet written)
    worker_args = ["--concurrency", str(args.concurrency)]
    with running_workers(args.gate_processes, worker_args) as workers:
        pg_before = pg.total(exclude_self=True)
        started = min(w.started_at for w in workers)
        deadline = time.monotonic() + 600
        with connection.cursor() as cur:
            while True:
                cur.execute(
                    f"SELECT (SELECT cur FROM {GAUGE_TABLE} WHERE name = %s), "
                    "(SELECT count(*) FROM jobs_job WHERE state = 'running' AND name = %s), "
                    f"({UNFINISHED})",
                    [name, name],
                )
                inside, engine, unfinished = cur.fetchone()
                now = time.monotonic()
                if not unfinished:
                    break
                samples.append(int(inside))
                running.append(int(engine))
                if now > deadline:
                    raise SystemExit(f"timed out with jobs not finished: {counts()}")
                time.sleep(0.02)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg_cpu = pg.total(exclude_self=True) - pg_before
    done = counts()
    if done.get("succeeded", 0) != args.gated_jobs:
        raise SystemExit(f"expected {args.gated_jobs} succeeded jobs, found {done}")
    with connection.cursor() as cur:
        cur.execute(f"SELECT cur, peak FROM {GAUGE_TABLE} WHERE name = %s", [name])
        left, peak = cur.fetchone()
        cur.execute(
            f"SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM {EVERY_JOB}"
        )
        span = float(cur.fetchone()[0])
    if left != 0:
        raise SystemExit(f"the gauge ends at {left} handlers inside, not 0")
    overlap = overlap_peak(name)
    wall = now - started
    ideal = args.limit / (args.ms / 1000)
    per_job = 1e6 / args.gated_jobs
    exceeded = peak > args.limit
    row = [
        args.limit,
        f"{args.gate_processes} x {args.concurrency}",
        peak,
        overlap,
        "YES" if exceeded else "no",
        statistics.mean(samples) if samples else float("nan"),
        statistics.mean(running) if running else float("nan"),
        args.gated_jobs / wall,
        args.gated_jobs / span,
        f"{args.gated_jobs / span / ideal:.0%}",
        worker_cpu * per_job,
        pg_cpu * per_job,
        (worker_cpu + pg_cpu) * per_job,
    ]
    return row, exceeded


def pg_clock() -> float:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT extract(epoch FROM clock_timestamp())")
        return float(cur.fetchone()[0])


def busiest_second(starts: list[float]) -> int:
    """The most starts within any 1 s (sliding over the sorted start times)."""
    best, first = 0, 0
    for last, at in enumerate(starts):
        while at - starts[first] >= 1.0:
            first += 1
        best = max(best, last - first + 1)
    return best


def rate(args: argparse.Namespace, pg: PostgresCpu) -> tuple[list[object], bool]:
    from django.db import connection

    from bench.benchapp.jobs import Rated
    from jobs import Rate

    limit = Rate(args.rate, per=1)
    name = Rated.job_name
    queued = int(2 * args.rate * (args.warmup + args.seconds)) + 1000
    truncate()
    enqueue(Rated, queued)
    vacuum()
    worker_args = ["--concurrency", str(args.concurrency)]
    with running_workers(args.rate_processes, worker_args) as workers:
        time.sleep(args.warmup)
        begin = pg_clock()
        cpu_before = sum(w.cpu() for w in workers)
        pg_before = pg.total(exclude_self=True)
        time.sleep(args.seconds)
        end = pg_clock()
        worker_cpu = sum(w.cpu() for w in workers) - cpu_before
        pg_cpu = pg.total(exclude_self=True) - pg_before
        left = counts().get("queued", 0)
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT extract(epoch FROM started_at) FROM {EVERY_JOB} WHERE name = %s "
            "AND started_at >= to_timestamp(%s) AND started_at < to_timestamp(%s) "
            "ORDER BY started_at",
            [name, begin, end],
        )
        starts = [float(at) for (at,) in cur.fetchall()]
    if not left:
        raise SystemExit(f"the {queued:,} queued jobs ran out before the window ended")
    window = end - begin
    observed = len(starts) / window
    deviation = observed / limit.per_second - 1
    per_second = [0] * int(window)
    for at in starts:
        if (second := int(at - begin)) < len(per_second):
            per_second[second] += 1
    # Between two claims the bucket fills in capacity / rate seconds; a longer gap wastes
    # the rest of it (the bucket is full): starts the window can never make up.
    fill = limit.capacity / limit.per_second
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    full = sum(max(0.0, gap - fill) for gap in gaps)
    per_job = 1e6 / max(len(starts), 1)
    row = [
        str(limit),
        limit.capacity,
        f"{args.rate_processes} x {args.concurrency}",
        window,
        len(starts),
        observed,
        f"{deviation:+.1%}",
        busiest_second(starts),
        min(per_second) if per_second else "n/a",
        max(per_second) if per_second else "n/a",
        max(gaps, default=0.0) * 1000,
        full,
        worker_cpu * per_job,
        pg_cpu * per_job,
        (worker_cpu + pg_cpu) / window,
    ]
    return row, abs(deviation) > RATE_TOLERANCE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=["gate", "rate"], default=["gate", "rate"])
    parser.add_argument("--limit", type=int, default=10, help="global_concurrency of the gate")
    parser.add_argument("--gated-jobs", type=int, default=5000)
    parser.add_argument("--ms", type=int, default=20, help="each gated handler's wait")
    parser.add_argument("--gate-processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=50, help="threads per worker")
    parser.add_argument("--rate", type=int, default=50, help="rate_limit, starts a second")
    parser.add_argument("--rate-processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0, help="the rate's window")
    parser.add_argument("--warmup", type=float, default=3.0, help="before the window opens")
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args()
    os.environ["BENCH_FLOW"] = "1"  # register the flow types (bench/benchapp/jobs.py)
    os.environ["BENCH_GLOBAL_CONCURRENCY"] = str(args.limit)
    os.environ["BENCH_RATE"] = str(args.rate)
    setup_bench()
    pg = PostgresCpu()
    missed = False
    tables = []
    if "gate" in args.part:
        row, exceeded = gate(args, pg)
        missed |= exceeded
        print(f"  gate: peak {row[2]} of {args.limit}", file=sys.stderr)
        tables.append(
            (
                f"global concurrency: {args.gated_jobs:,} jobs of bench.gated.v1, each "
                f"waiting {args.ms} ms (ideal {args.limit / (args.ms / 1000):,.0f} jobs/s: "
                "limit / wait); target: peak ≤ limit",
                [
                    "limit",
                    "procs x conc",
                    "peak (handlers)",
                    "peak (claim..outcome)",
                    "exceeded",
                    "mean inside",
                    "mean running",
                    "jobs/s",
                    "db jobs/s",
                    "of ideal",
                    "worker CPU µs/job",
                    "PG CPU µs/job",
                    "total CPU µs/job",
                ],
                [row],
            )
        )
    if "rate" in args.part:
        row, off = rate(args, pg)
        missed |= off
        print(f"  rate: {row[5]:.1f}/s against {args.rate}/s", file=sys.stderr)
        tables.append(
            (
                f"rate limit: bench.rated.v1 (no-op), starts counted over the window "
                f"(after {args.warmup:g} s); target: within {RATE_TOLERANCE:.0%} of the limit",
                [
                    "limit",
                    "bucket",
                    "procs x conc",
                    "window s",
                    "starts",
                    "starts/s",
                    "deviation",
                    "max in 1 s",
                    "min/whole s",
                    "max/whole s",
                    "max gap ms",
                    "bucket full s",
                    "worker CPU µs/job",
                    "PG CPU µs/job",
                    "CPU cores",
                ],
                [row],
            )
        )
    truncate()
    for number, (title, headers, rows) in enumerate(tables):
        print(("\n" if number else "") + title)
        print(table(headers, rows))
    if not pg.available:
        print("(PostgreSQL CPU not measured: the server does not run on this machine)")
    failed = report_problems()
    if args.check and missed:
        return 1
    return failed


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
