"""Enqueue throughput: one job per transaction, and batches of 1,000 in one transaction.

``single`` enqueues each job inside its own ``transaction.atomic()`` (as a caller with a
business write does); ``alone`` calls ``enqueue`` with no transaction open (one statement,
in autocommit). ``batched`` enqueues each batch inside ``transaction.atomic()`` (the whole
batch is checked before it is sent); ``batched alone`` calls ``enqueue_many`` with no
transaction open (a batch of 64 jobs or more is checked while ``COPY`` streams it).

    .venv/bin/python bench/enqueue.py [--single 2000] [--batched 50000] [--batch-size 1000]
                                      [--profile]

Uses the scratch database ``<db>_bench`` (emptied first) and the no-op type ``bench.noop.v1``.
For each mode, prints jobs/s and CPU milliseconds per job of this (client) process
(``time.process_time``) and of PostgreSQL (the bench database's backends and the server's
background processes, from /proc), with NOTIFY on (the default) and off. Payloads are built
before the clock starts. ``--profile`` adds a cProfile of the client for 10 batches. With
``--check``, exits 1 if batched enqueue is below the target (20,000 jobs/s).
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import PostgresCpu, counts, setup_bench, table, truncate, vacuum

BATCH_TARGET = 20_000  # jobs/s


def measure(
    label: str, count: int, batch_size: int, pg: PostgresCpu, *, atomic: bool = True
) -> list[object]:
    from django.db import transaction

    import jobs
    from bench.benchapp.jobs import Noop

    truncate()
    vacuum()
    payloads = [Noop(n=i) for i in range(count)]
    pg_before = pg.total()
    cpu_before = time.process_time()
    started = time.perf_counter()
    if batch_size == 1 and not atomic:
        for payload in payloads:
            jobs.enqueue(payload)
    elif batch_size == 1:
        for payload in payloads:
            with transaction.atomic():
                jobs.enqueue(payload)
    elif not atomic:
        for first in range(0, count, batch_size):
            jobs.enqueue_many(payloads[first : first + batch_size])
    else:
        for first in range(0, count, batch_size):
            with transaction.atomic():
                jobs.enqueue_many(payloads[first : first + batch_size])
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu_before
    pg_cpu = pg.total() - pg_before
    found = counts().get("queued", 0)
    if found != count:
        raise SystemExit(f"{label}: expected {count} queued jobs, found {found}")
    return [
        label,
        count,
        batch_size,
        count / elapsed,
        elapsed / count * 1000,
        client_cpu / count * 1000,
        pg_cpu / count * 1000,
    ]


def profile_batches(batch_size: int, top: int) -> None:
    """cProfile ``enqueue_many`` of 10 batches and list the top functions by own time."""
    import cProfile
    import pstats

    import jobs
    from bench.benchapp.jobs import Noop

    truncate()
    batches = [[Noop(n=i) for i in range(batch_size)] for _ in range(10)]
    profiler = cProfile.Profile()
    profiler.enable()
    for batch in batches:
        jobs.enqueue_many(batch)
    profiler.disable()
    truncate()
    stats = pstats.Stats(profiler)
    total = sum(entry[2] for entry in stats.stats.values())
    jobs_count = 10 * batch_size
    rows = []
    for (file, line, func), (_cc, calls, own, cum, _callers) in stats.stats.items():
        short = file.rsplit("site-packages/", 1)[-1].rsplit("/work/main/", 1)[-1]
        rows.append(
            [f"{short}:{line}({func})", calls, own * 1e6 / jobs_count, cum * 1e6 / jobs_count]
        )
    rows.sort(key=lambda row: -row[2])
    print(
        f"\ncProfile of enqueue_many, 10 batches of {batch_size:,} "
        f"({total * 1e6 / jobs_count:.1f} µs/job under the profiler), top by own time:"
    )
    print(table(["function", "calls", "own µs/job", "cum µs/job"], rows[:top]))
    rows.sort(key=lambda row: -row[3])
    print("\ntop by cumulative time:")
    print(table(["function", "calls", "own µs/job", "cum µs/job"], rows[:top]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=2000, help="jobs enqueued one by one")
    parser.add_argument("--batched", type=int, default=50_000, help="jobs enqueued in batches")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--check", action="store_true", help="exit 1 if below the target")
    parser.add_argument("--top", type=int, default=15, help="functions listed by --profile")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile 10 batches and print where the client's time goes",
    )
    args = parser.parse_args()
    setup_bench()
    from django.test import override_settings

    pg = PostgresCpu()
    rows = []
    for notify in (True, False):
        with override_settings(JOBS={"NOTIFY": notify}):
            suffix = "" if notify else ", no NOTIFY"
            rows.append(measure(f"single{suffix}", args.single, 1, pg))
            rows.append(measure(f"alone{suffix}", args.single, 1, pg, atomic=False))
            rows.append(measure(f"batched{suffix}", args.batched, args.batch_size, pg))
            rows.append(
                measure(f"batched alone{suffix}", args.batched, args.batch_size, pg, atomic=False)
            )
    truncate()
    print(
        table(
            [
                "mode",
                "jobs",
                "batch",
                "jobs/s",
                "wall ms/job",
                "client CPU ms/job",
                "PG CPU ms/job",
            ],
            rows,
        )
    )
    if not pg.available:
        print("(PostgreSQL CPU not measured: the server does not run on this machine)")
    if args.profile:
        profile_batches(args.batch_size, args.top)
    batched = rows[2][3]
    print(f"\nbatched (NOTIFY on): {batched:,.0f} jobs/s, target ≥ {BATCH_TARGET:,}")
    if args.check and batched < BATCH_TARGET:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
