"""Drain throughput: 10,000 queued no-op jobs, run by 1 and by 2 worker processes.

    .venv/bin/python bench/drain.py [--jobs 10000] [--concurrency 10 50 100] [--processes 1 2]
    .venv/bin/python bench/drain.py --type touch --processes 2 --concurrency 10 100
    .venv/bin/python bench/drain.py --type touch --conn-max-age 60 --processes 2 \
        --concurrency 10 100

For each (processes, concurrency) pair: empty the bench table, enqueue the jobs in batches of
1,000 (before any worker runs), start the workers (``manage.py runworker --concurrency C``,
``DJANGO_SETTINGS_MODULE=bench.settings``), poll the table every 10 ms until every job has
succeeded, then stop the workers (SIGTERM). Prints per run:

- ``wall s``: from the workers' start (the moment each logged "worker … started", i.e. after
  Django start-up) until the poll saw no queued or running job; ``jobs/s`` is jobs / that;
- ``db s``: PostgreSQL's clock from the first claim to the last outcome (``started_at`` /
  ``finished_at``), the steady-state figure without start-up and polling granularity;
- ``all-up jobs/s``: the outcomes written after the last worker's first claim, over the time
  from that claim to the last outcome: the workers start one after another (each one's
  Django start-up takes a CPU for a moment), and until the last has claimed, fewer handlers
  run than the ideal of the I/O-bound types counts;
- CPU µs per job of the worker processes (without their Django start-up) and of PostgreSQL
  (see ``_common.PostgresCpu``: the bench database's backends less the one serving this
  script's polls, the background processes, the postmaster and backends that exited), and
  both together;
- write transactions (transaction ids assigned: claims, outcome flushes, lease renewals) and
  bytes of WAL per job.

``--type touch`` runs ``bench.touch.v1`` instead (each handler runs one ``SELECT 1`` on
Django's connection); ``--conn-max-age N|none`` sets the workers' ``CONN_MAX_AGE``. Extra
``runworker`` options go after ``--``.

With ``--check``, exits 1 if the best 2-process run is below 3,000 jobs/s.

``--type sleep`` / ``asleep`` (each handler waits 50 ms, in ``time.sleep`` / awaiting
``asyncio.sleep``) measure handlers that wait on I/O: the ideal is the slots in flight over
50 ms (2,000 jobs/s for 1 x 100, 10,000 for 5 x 100), and each row's ``db jobs/s`` is also
printed as a share of it; with ``--check`` every row must reach 80 %::

    .venv/bin/python bench/drain.py --type asleep --processes 1 --concurrency 100 --jobs 10000
    .venv/bin/python bench/drain.py --type asleep --processes 5 --concurrency 100 --jobs 25000

With ``-- --prefetch 100`` the workers hold jobs beyond their slots, so a slot that frees
starts the next at once rather than after the next pass (docs/worker.md#prefetch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _common import (
    EVERY_JOB,
    PostgresCpu,
    db_counters,
    enqueue_noops,
    out_path,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
    wait_until_done,
)

TARGET = 3_000  # jobs/s with 2 processes
#: Handlers that wait this long (the payloads' default ``ms``): the I/O-bound types.
WAITS = {"sleep": 0.05, "asleep": 0.05}
IO_TARGET = 0.8  # of the ideal, slots in flight / the wait


def db_span() -> float:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM {EVERY_JOB}"
        )
        (span,) = cur.fetchone()
    return float(span)


def all_running_rate() -> float:
    """Jobs a second from the moment the last worker made its first claim to the last outcome.

    The workers start one after another (each one's Django start-up takes a CPU for a
    moment), and until the last one claims, fewer handlers run than the ideal counts.
    """
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            f"""
            WITH up AS (
                SELECT max(first) AS at FROM (
                    SELECT min(started_at) AS first FROM {EVERY_JOB} GROUP BY claimed_by
                ) AS workers
            )
            SELECT count(*) FILTER (WHERE finished_at > up.at),
                   extract(epoch FROM max(finished_at) - up.at)
            FROM {EVERY_JOB}, up GROUP BY up.at
            """
        )
        count, span = cur.fetchone()
    return count / float(span) if span else 0.0


def run(
    processes: int, concurrency: int, jobs: int, pg: PostgresCpu, kind: str, extra: list[str]
) -> list:
    truncate()
    enqueue_noops(jobs, kind=kind)
    vacuum()
    args = ["--concurrency", str(concurrency), *extra]
    with running_workers(processes, args) as workers:
        pg_before = pg.total(exclude_self=True)
        xid_before, wal_before = db_counters()
        started = min(w.started_at for w in workers)
        finished = wait_until_done(jobs, timeout=300)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg_cpu = pg.total(exclude_self=True) - pg_before
        xid_after, wal_after = db_counters()
    wall = finished - started
    span = db_span()
    all_running = all_running_rate()
    per_job = 1e6 / jobs
    return [
        processes,
        concurrency,
        wall,
        jobs / wall,
        span,
        jobs / span,
        worker_cpu * per_job,
        pg_cpu * per_job,
        (worker_cpu + pg_cpu) * per_job,
        (xid_after - xid_before) / jobs,
        (wal_after - wal_before) / jobs,
        all_running,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument(
        "--type",
        choices=["noop", "touch", "append", "sleep", "asleep"],
        default="noop",
        help="job type bench.TYPE.v1 (see bench/benchapp/jobs.py): noop, touch (one SELECT 1),"
        " append (one O_APPEND write), sleep / asleep (wait 50 ms, sync / async def)",
    )
    parser.add_argument(
        "--conn-max-age",
        help="CONN_MAX_AGE of the workers (seconds or 'none'); default: the project's (0)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if below the target")
    parser.add_argument(
        "worker_args", nargs="*", help="extra runworker options, after --, e.g. -- --no-listen"
    )
    args = parser.parse_args()
    if args.conn_max_age is not None:
        os.environ["BENCH_CONN_MAX_AGE"] = args.conn_max_age
    os.environ.setdefault("BENCH_APPEND_FILE", str(out_path("append.log")))
    setup_bench()
    pg = PostgresCpu()
    rows = []
    for processes in args.processes:
        for concurrency in args.concurrency:
            row = run(processes, concurrency, args.jobs, pg, args.type, args.worker_args)
            rows.append(row)
            print(f"  {processes} x {concurrency}: {row[3]:,.0f} jobs/s", file=sys.stderr)
    truncate()
    print(f"job type: bench.{args.type}.v1, {args.jobs:,} jobs")
    print(
        table(
            [
                "procs",
                "conc",
                "wall s",
                "jobs/s",
                "db s",
                "db jobs/s",
                "worker CPU µs/job",
                "PG CPU µs/job",
                "total CPU µs/job",
                "write txn/job",
                "WAL B/job",
                "all-up jobs/s",
            ],
            rows,
        )
    )
    if not pg.available:
        print("(PostgreSQL CPU not measured: the server does not run on this machine)")
    missed = False
    if wait := WAITS.get(args.type):
        print()
        for procs, conc, *_, db_rate, all_up in (row[:6] + row[-1:] for row in rows):
            ideal = procs * conc / wait
            missed |= db_rate < IO_TARGET * ideal
            print(
                f"{procs} x {conc}: {db_rate:,.0f} db jobs/s = {db_rate / ideal:.0%} of the ideal "
                f"{ideal:,.0f} ({procs * conc} in flight / {wait * 1000:g} ms), "
                f"target ≥ {IO_TARGET:.0%}; once every worker had claimed: {all_up:,.0f} = "
                f"{all_up / ideal:.0%}"
            )
    two = [row[3] for row in rows if row[0] == 2]
    if two and not wait:
        print(f"\nbest with 2 processes: {max(two):,.0f} jobs/s, target ≥ {TARGET:,}")
        missed = max(two) < TARGET
    failed = report_problems()
    if args.check and missed:
        return 1
    return failed


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
