"""Time the lease renewal of held jobs with and without progress reports riding on it.

    .venv/bin/python bench/progress_renewal.py [--held 100] [--rounds 300]

Claims ``--held`` jobs in a scratch database (``<db>_progress_bench``), then times
``jobs.queue.renew_leases`` for all of them (one statement, committed, as the lease keeper
makes it), alternating rounds so a noisy machine affects all alike:

* ``none``: no job has reported (the keeper passes no reports, as before progress existed);
* ``1 reports``: one held job has a new report;
* ``all report``: every held job has a new report.

Prints the median and p95 of each, and the ratio to ``none``; then, for each on fresh rows,
the share of the renewed rows that were HOT updates (``pg_stat_user_tables``; PostgreSQL 15+).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _setup import setup

NAME = "bench.progress.v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    setup("_progress_bench")
    from django.db import connection

    from jobs.core.progress import Progress
    from jobs.queue import AllTenants, ClaimRequest, NewJob, claim, enqueue_many, renew_leases

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job")
    enqueue_many([NewJob(NAME) for _ in range(args.held)])
    held = claim([ClaimRequest(NAME, args.held)], scope=AllTenants(), worker="bench")
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")

    def reports(count: int, round_: int) -> dict:
        return {
            job.claim_token: Progress(round_, args.rounds, f"item {round_} of job {job.id}")
            for job in held[:count]
        }

    modes = {
        "none": lambda r: renew_leases(held),
        "1 reports": lambda r: renew_leases(held, progress=reports(1, r)),
        "all report": lambda r: renew_leases(held, progress=reports(len(held), r)),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode, renew in modes.items():
            started = time.perf_counter()
            renewal = renew(round_)
            times[mode].append(time.perf_counter() - started)
            assert not renewal.lost, "a renewal lost a lease"

    base = statistics.median(times["none"])
    print(f"renew_leases of {args.held} held jobs, {args.rounds} rounds each (ms):")
    for mode, seen in times.items():
        seen.sort()
        median = statistics.median(seen)
        p95 = seen[int(len(seen) * 0.95)]
        print(
            f"  {mode:<11} median {median * 1000:6.3f}  p95 {p95 * 1000:6.3f}  x{median / base:.2f}"
        )
    # HOT updates, by mode: each on a fresh set of held jobs, its own counts flushed before
    # and after (a HOT update needs room on the row's page too: fillfactor 80).
    print(f"HOT share of the rows {args.rounds} renewals updated, each mode on fresh rows:")
    for mode, renew in modes.items():
        with connection.cursor() as cur:
            cur.execute("TRUNCATE jobs_job")
        enqueue_many([NewJob(NAME) for _ in range(args.held)])
        held[:] = claim([ClaimRequest(NAME, args.held)], scope=AllTenants(), worker="bench")
        before = _updates(connection)
        for round_ in range(args.rounds):
            renew(round_)
        after = _updates(connection)
        rows, hot = after[0] - before[0], after[1] - before[1]
        print(f"  {mode:<11} {rows:6d} rows, {hot:6d} HOT ({hot / rows:.0%})")


def _updates(connection: Any) -> tuple[int, int]:
    """The jobs table's updated rows and HOT updates so far, this session's included."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")  # at this statement's end
    with connection.cursor() as cur:
        cur.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs_job'"
        )
        updated, hot = cur.fetchone()
    return updated, hot


if __name__ == "__main__":
    main()
