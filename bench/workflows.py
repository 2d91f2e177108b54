"""What the workflow features cost: the drain, and the claim beside waiting jobs.

    .venv/bin/python bench/workflows.py [--jobs 10000] [--runs 3] [--waiting 100000]
                                        [--shapes plain,pairs,...]

**Drain.** 2 worker processes (``--concurrency 100``, or ``--concurrency N``) drain
``--jobs`` jobs in each shape, alternating shapes run by run so a noisy machine affects all
alike:

* ``plain``: independent no-op jobs (the baseline);
* ``one batch``: every job a member of one batch, with a successor: every outcome also
  counts on the batch's one row (the settle trigger), and the members' outcomes wait on each
  other's row lock;
* ``batches of 100``: the same with a batch per 100 jobs;
* ``pairs``: half the jobs wait for one job of the other half (``after=``): each success of
  the first half releases its waiting job through the trigger.

Prints jobs/s (from the first claim to the last outcome, PostgreSQL's clock), CPU µs per
job of the workers and of PostgreSQL, and each shape's ratio to ``plain`` (medians of the
runs).

**Claim.** Times the claim of 10 due jobs with ``--waiting`` jobs of the same type waiting
for others beside them, against the same claim with none (each claim a rolled-back
transaction, alternating): waiting jobs sit at the far end of the claim index's range, so
the ratio should be about 1.
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
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
    wait_until_done,
)

NAME = "bench.noop.v1"
SHAPES = (
    "plain",
    "one batch",
    "batches of 100",
    "pairs",
    "touch",
    "progress",
    "effect key",
    "effect journal",
    "complete()",
)
#: The shapes whose jobs are each of a type of its own (bench/benchapp/jobs.py), by the name
#: of their payload class there.
HELPER_SHAPES = {
    "touch": "Touch",
    "progress": "Progress",
    "effect key": "EffectKey",
    "effect journal": "Journal",
    "complete()": "Complete",
}
# Register those types, here and in the workers this starts (they inherit the environment).
os.environ["BENCH_HELPERS"] = "1"


def enqueue_shape(shape: str, count: int) -> int:
    """Enqueue ``count`` jobs in ``shape``; returns how many jobs will succeed in all."""
    import jobs
    from bench.benchapp import jobs as types
    from bench.benchapp.jobs import Noop

    if shape == "plain" or shape in HELPER_SHAPES:
        payload = getattr(types, HELPER_SHAPES.get(shape, "Noop"))
        for first in range(0, count, 1000):
            jobs.enqueue_many([payload(n=i) for i in range(first, min(first + 1000, count))])
        return count
    if shape in ("one batch", "batches of 100"):
        size = count if shape == "one batch" else 100
        made = 0
        for first in range(0, count, size):
            with jobs.batch(successor=Noop(n=-1)) as group:
                last = min(first + size, count)
                for start in range(first, last, 1000):
                    group.enqueue_many([Noop(n=i) for i in range(start, min(start + 1000, last))])
            made += 1
        return count + made
    half = count // 2
    for first in range(0, half, 500):
        ups = jobs.enqueue_many([Noop(n=i) for i in range(first, min(first + 500, half))])
        jobs.enqueue_many(
            [jobs.JobSpec(payload=Noop(n=-i), after=[up]) for i, up in enumerate(ups)]
        )
    return 2 * half


def db_rate(expected: int) -> float:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM {EVERY_JOB}"
        )
        (span,) = cur.fetchone()
    return expected / float(span)


def drain(shape: str, count: int, pg: PostgresCpu, concurrency: int) -> tuple[float, float, float]:
    truncate()
    with_connection_truncate_batches()
    expected = enqueue_shape(shape, count)
    vacuum()
    with running_workers(2, ["--concurrency", str(concurrency)]) as workers:
        pg_before = pg.total(exclude_self=True)
        wait_until_done(expected, timeout=300)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg_cpu = pg.total(exclude_self=True) - pg_before
    return db_rate(expected), worker_cpu * 1e6 / expected, pg_cpu * 1e6 / expected


def with_connection_truncate_batches() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_batch, jobs_dependency")


def claim_cost(waiting: int, rounds: int) -> tuple[float, float]:
    """Median claim time (ms) with no waiting jobs and with ``waiting`` of them."""
    from django.db import connection, transaction

    from jobs.queue import AllTenants, ClaimRequest, claim

    truncate()
    fill = """
        INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts,
                              run_after, state, attempts, last_error, error_detail, claimed_by,
                              key_held, replayed_by, created_at, waiting_on)
        SELECT %(prefix)s || g, %(name)s, '{}', 'default', 'default', 0, 5, %(at)s, 'queued',
               0, '', '', '', TRUE, '', now(), %(waits)s
        FROM generate_series(1, %(count)s) AS g
    """
    times: dict[bool, list[float]] = {False: [], True: []}
    with connection.cursor() as cur:
        cur.execute(
            fill, {"prefix": "due-", "name": NAME, "at": "-infinity", "waits": 0, "count": 10_000}
        )
    vacuum()
    for with_waiting in (False, True):
        if with_waiting:
            with connection.cursor() as cur:
                cur.execute(
                    fill,
                    {
                        "prefix": "wait-",
                        "name": NAME,
                        "at": None,  # not due: it waits for another job
                        "waits": 1,
                        "count": waiting,
                    },
                )
            vacuum()
        for _ in range(rounds):
            with transaction.atomic():
                started = time.perf_counter()
                claimed = claim([ClaimRequest(NAME, 10)], scope=AllTenants(), worker="bench")
                times[with_waiting].append(time.perf_counter() - started)
                transaction.set_rollback(True)
            assert len(claimed) == 10
    truncate()
    return statistics.median(times[False]) * 1000, statistics.median(times[True]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--waiting", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=100, help="each worker's")
    parser.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help="the drain shapes to run, comma-separated (plain, the baseline, always runs)",
    )
    args = parser.parse_args()
    shapes = ["plain", *(s for s in args.shapes.split(",") if s and s != "plain")]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    setup_bench()
    pg = PostgresCpu()

    without, beside = claim_cost(args.waiting, args.rounds)
    print(
        f"claim of 10 from 10,000 due jobs: {without:.3f} ms; with {args.waiting:,} waiting "
        f"jobs of the same type beside them: {beside:.3f} ms ({beside / without:.2f}x)\n"
    )

    results: dict[str, list[tuple[float, float, float]]] = {shape: [] for shape in shapes}
    for run in range(args.runs):
        for shape in shapes:
            results[shape].append(drain(shape, args.jobs, pg, args.concurrency))
            print(f"  run {run + 1} {shape}: {results[shape][-1][0]:,.0f} jobs/s", file=sys.stderr)
    truncate()
    with_connection_truncate_batches()
    base = statistics.median(r[0] for r in results["plain"])
    base_cpu = statistics.median(r[1] + r[2] for r in results["plain"])
    rows = []
    for shape, samples in results.items():
        rate = statistics.median(r[0] for r in samples)
        worker = statistics.median(r[1] for r in samples)
        postgres = statistics.median(r[2] for r in samples)
        rows.append(
            [
                shape,
                rate,
                f"{rate / base:.2f}x",
                worker,
                postgres,
                worker + postgres,
                f"{(worker + postgres) / base_cpu:.2f}x",
            ]
        )
    print(
        f"drain of {args.jobs:,} jobs, 2 processes x {args.concurrency}, median of {args.runs} runs"
    )
    print(
        table(
            ["shape", "jobs/s", "vs plain", "worker µs/job", "PG µs/job", "CPU µs/job", "vs plain"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
