"""Fairness between tenants: a small tenant's latency behind a big tenant's backlog.

    .venv/bin/python bench/fairness.py [--runs 3] [--jobs 100000] [--b-jobs 100]
    .venv/bin/python bench/fairness.py --runs 1 --jobs 5000       # smoke run, about 30 s

Each run empties the bench table, enqueues ``--jobs`` no-op jobs for tenant A (batches of
1,000, before any worker runs), starts ``--processes`` workers (``manage.py runworker
--concurrency C``, as bench/drain.py does) and, once A's drain is under way (the job enqueued
at ``--b-at`` of A's backlog, 10 % by default, has been claimed), enqueues ``--b-jobs`` jobs
for tenant B in one transaction; then polls every 10 ms until every job has succeeded and
stops the workers.

The two modes drain the same no-op handler under two job types that differ only in
``fair``: ``off`` is ``bench.tenants.v1`` (``fair=False``: the claim takes the earliest due
first, so B waits behind the rest of A's backlog), ``on`` is ``bench.fair.v1`` (``fair=True``:
the claim takes the tenants in weighted fair order). The modes alternate (off, on; then on,
off; ...) for ``--runs`` runs, and the table has the medians of each mode. Prints per mode:

- ``B p50 / p95 / max ms``: B's queue latency, each job's ``started_at - run_after`` from the
  database (PostgreSQL's clock; ``run_after`` is the enqueue's commit time here);
- ``A queued``: A's jobs still queued when B's were committed (what B would wait behind);
- ``wall s`` and ``jobs/s``: all of A's and B's jobs over the time from the workers' start
  (each logged that it started) until the poll saw none queued or running; ``db jobs/s``:
  the same jobs over PostgreSQL's first claim to last outcome;
- CPU µs per job of the worker processes and of PostgreSQL, and both together, measured as
  bench/drain.py does (see ``_common.PostgresCpu``);

and a row of ratios on / off. Targets: B's p95 with fairness on ≤ 1 s, throughput (``jobs/s``)
on ≥ 0.9x off. With ``--check``, exits 1 if either is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import (
    EVERY_JOB,
    PostgresCpu,
    percentile,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
    wait_until_done,
)

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
TARGET_P95_MS = 1000.0  # B's p95 with fairness on
TARGET_RATE_RATIO = 0.9  # jobs/s on / off
MODES = ("off", "on")


def payload_class(mode: str) -> type:
    from bench.benchapp import jobs as bench_jobs

    return {"off": bench_jobs.Tenants, "on": bench_jobs.Fair}[mode]


def enqueue_a(payload: type, count: int, mark: int) -> str:
    """Enqueue A's backlog in batches of 1,000; returns the id of job number ``mark``."""
    import jobs

    marker = ""
    for first in range(0, count, 1000):
        batch = range(first, min(first + 1000, count))
        done = jobs.enqueue_many([payload(n=i) for i in batch], tenant=TENANT_A)
        if first <= mark < first + len(batch):
            marker = str(done[mark - first].id)
    return marker


def wait_claimed(job: str, timeout: float) -> None:
    """Poll (every 10 ms, a primary key lookup) until ``job`` is no longer queued."""
    from django.db import connection

    deadline = time.monotonic() + timeout
    with connection.cursor() as cur:
        while True:
            cur.execute("SELECT state FROM jobs_job WHERE id = %s", [job])
            row = cur.fetchone()
            if row is None or row[0] != "queued":  # gone: it ended and left for the history
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"A's job {job} was not claimed within {timeout:g} s")
            time.sleep(0.01)


def queued_of(tenant: str) -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM jobs_job WHERE tenant = %s AND state = 'queued'", [tenant]
        )
        return int(cur.fetchone()[0])


def latencies(tenant: str) -> list[float]:
    """Queue latency in ms (``started_at - run_after``) of every job of ``tenant``."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"SELECT extract(epoch FROM started_at - run_after) * 1000 FROM {EVERY_JOB} "
            "WHERE tenant = %s",
            [tenant],
        )
        return [float(value) for (value,) in cur.fetchall()]


def db_span() -> float:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM {EVERY_JOB}"
        )
        (span,) = cur.fetchone()
    return float(span)


def run(mode: str, args: argparse.Namespace, pg: PostgresCpu) -> dict[str, float]:
    import jobs

    payload = payload_class(mode)
    truncate()
    marker = enqueue_a(payload, args.jobs, int(args.jobs * args.b_at))
    vacuum()
    total = args.jobs + args.b_jobs
    with running_workers(args.processes, ["--concurrency", str(args.concurrency)]) as workers:
        pg_before = pg.total(exclude_self=True)
        started = min(w.started_at for w in workers)
        wait_claimed(marker, timeout=120)
        jobs.enqueue_many([payload(n=-1 - i) for i in range(args.b_jobs)], tenant=TENANT_B)
        a_queued = queued_of(TENANT_A)
        finished = wait_until_done(total, timeout=600)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg_cpu = pg.total(exclude_self=True) - pg_before
    wall = finished - started
    b = latencies(TENANT_B)
    per_job = 1e6 / total
    return {
        "b_p50": percentile(b, 50),
        "b_p95": percentile(b, 95),
        "b_max": max(b),
        "a_queued": a_queued,
        "wall": wall,
        "rate": total / wall,
        "db_rate": total / db_span(),
        "worker_cpu": worker_cpu * per_job,
        "pg_cpu": pg_cpu * per_job,
        "cpu": (worker_cpu + pg_cpu) * per_job,
    }


FIELDS = (
    ("B p50 ms", "b_p50"),
    ("B p95 ms", "b_p95"),
    ("B max ms", "b_max"),
    ("A queued", "a_queued"),
    ("wall s", "wall"),
    ("jobs/s", "rate"),
    ("db jobs/s", "db_rate"),
    ("worker CPU µs/job", "worker_cpu"),
    ("PG CPU µs/job", "pg_cpu"),
    ("total CPU µs/job", "cpu"),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="tenant A's backlog")
    parser.add_argument("--b-jobs", type=int, default=100, help="tenant B's jobs")
    parser.add_argument(
        "--b-at",
        type=float,
        default=0.1,
        help="B enqueues once the job at this share of A's backlog has been claimed",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode (medians)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args()
    os.environ["BENCH_FLOW"] = "1"  # register the flow types (bench/benchapp/jobs.py)
    setup_bench()
    pg = PostgresCpu()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for number in range(args.runs):
        for mode in MODES if number % 2 == 0 else MODES[::-1]:
            result = run(mode, args, pg)
            results[mode].append(result)
            print(
                f"  run {number + 1}, fairness {mode}: B p95 {result['b_p95']:,.0f} ms, "
                f"{result['rate']:,.0f} jobs/s, {result['cpu']:,.0f} µs/job",
                file=sys.stderr,
            )
    truncate()
    medians = {
        mode: {key: statistics.median(r[key] for r in results[mode]) for _, key in FIELDS}
        for mode in MODES
    }
    rows: list[list[object]] = [
        [f"fairness {mode}", *(medians[mode][key] for _, key in FIELDS)] for mode in MODES
    ]
    ratio = ["on / off"]
    for _, key in FIELDS:
        off, on = medians["off"][key], medians["on"][key]
        ratio.append(f"{on / off:.2f}x" if off else "n/a")
    rows.append(ratio)
    print(
        f"tenant A: {args.jobs:,} no-op jobs; tenant B: {args.b_jobs:,}, enqueued once "
        f"{args.b_at:.0%} of A's were claimed; {args.processes} processes x "
        f"{args.concurrency}; median of {args.runs} run{'s' * (args.runs > 1)} per mode"
    )
    print(table(["", *(name for name, _ in FIELDS)], rows))
    if not pg.available:
        print("(PostgreSQL CPU not measured: the server does not run on this machine)")
    p95 = medians["on"]["b_p95"]
    rate_ratio = medians["on"]["rate"] / medians["off"]["rate"]
    p95_ok = p95 <= TARGET_P95_MS
    rate_ok = rate_ratio >= TARGET_RATE_RATIO
    print(
        f"\nB p95 with fairness on: {p95:,.0f} ms, target ≤ {TARGET_P95_MS:,.0f} ms"
        f"{'' if p95_ok else '  MISSED'}"
    )
    print(
        f"throughput on / off: {rate_ratio:.2f}x, target ≥ {TARGET_RATE_RATIO}x"
        f"{'' if rate_ok else '  MISSED'}"
    )
    failed = report_problems()
    if args.check and not (p95_ok and rate_ok):
        return 1
    return failed


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
