"""What ending a job costs with many jobs waiting for it, and how fast they are released.

    .venv/bin/python bench/fanout.py [--dependents 1,1000,1000000] [--step 5000]

For each count, on the scratch database (emptied first): one job and that many jobs waiting
for it (``after=``), the job claimed, then its outcome written (``jobs.queue.complete``, the
statement the worker's pass runs for it). Prints the outcome write's wall time and
PostgreSQL's CPU for it, then the release of the waiting jobs after it
(``jobs.queue.dependencies.release`` steps of ``--step``, to the end): its time and rate.
The first row (one waiting job) is the baseline of the ratios.
"""

from __future__ import annotations

import argparse
import time

from _common import PostgresCpu, setup_bench, table, truncate, vacuum

UP, DOWN = "bench.noop.v1", "bench.noop.v1"


def fill(count: int) -> int:
    """The job waited for and ``count`` jobs waiting for it; its id."""
    from django.db import connection

    from jobs.queue import NewJob, enqueue, enqueue_many

    upstream = enqueue(NewJob(name=UP, queue="up")).id
    chunk = 10_000
    for first in range(0, count, chunk):
        enqueue_many(
            [NewJob(name=DOWN, after=(upstream,)) for _ in range(min(chunk, count - first))]
        )
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_dependency")
    return upstream


def measure(count: int, step: int) -> tuple[float, float, float]:
    """(outcome write ms, PostgreSQL CPU ms of it, release seconds) for ``count`` waiting."""
    from django.db import connection

    from jobs import queue
    from jobs.queue import AllTenants, ClaimRequest, dependencies

    truncate()
    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_dependency")
        cur.execute("SELECT to_regclass('jobs_settlement') IS NOT NULL")
        if cur.fetchone()[0]:
            cur.execute("TRUNCATE jobs_settlement")
    fill(count)
    vacuum()
    [job] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants())
    backend = PostgresCpu().own_backend  # this connection's server process
    assert backend is not None, "the bench needs PostgreSQL on this machine"
    before = sum(backend.cpu_times()[:2])
    started = time.perf_counter()
    assert queue.complete(job)
    wrote = time.perf_counter() - started
    cpu = sum(backend.cpu_times()[:2]) - before
    started = time.perf_counter()
    release = getattr(dependencies, "release", None)
    while release is not None and release(step=step).upstream is not None:
        pass
    released = time.perf_counter() - started
    return wrote * 1000, cpu * 1000, released


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dependents", default="1,1000,1000000")
    parser.add_argument("--step", type=int, default=5000)
    args = parser.parse_args()
    setup_bench()
    counts = [int(n) for n in args.dependents.split(",")]
    measure(1, args.step)  # warm up: plans, caches
    rows = []
    base: float | None = None
    for count in counts:
        wrote, cpu, released = measure(count, args.step)
        base = base or wrote
        rate = count / released if released else float("inf")
        rows.append(
            [
                f"{count:,}",
                f"{wrote:.2f}",
                f"{wrote / base:.2f}x",
                f"{cpu:.2f}",
                f"{released:.2f}",
                f"{rate:,.0f}",
            ]
        )
        print(f"{count:,} waiting: outcome {wrote:.2f} ms, release {released:.2f} s", flush=True)
    print()
    print(
        table(
            [
                "waiting jobs",
                "outcome write ms",
                "vs 1",
                "PostgreSQL CPU ms",
                "release s",
                "released/s",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
