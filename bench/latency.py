"""Idle pickup latency: one job at a time into an idle worker, with NOTIFY on and off.

    .venv/bin/python bench/latency.py [--jobs 200] [--jobs-no-listen 100] [--poll 0.5]

For each mode, starts one worker (``manage.py runworker --concurrency 10``, default poll
interval 0.5 s; the second mode adds ``--no-listen``), lets it go idle, then enqueues
``bench.noop.v1`` jobs one at a time, each in its own transaction, waiting for each to finish
before the next. Before each enqueue it pauses a random time (0-20 ms with NOTIFY; 0 to the
poll interval without, since waiting for the previous job otherwise locks every enqueue to
the same phase of the worker's fixed poll cadence, just after a poll).

pickup = the handler's ``time.time()`` at start (its return value, stored as the job's
result) minus this process's ``time.time()`` right after the enqueue committed (same machine
clock). It splits into ``→claim`` (commit until the claim statement started, PostgreSQL's
``started_at``) and ``claim→handler`` (claim statement, commit, dispatch to a handler
thread). ``done`` = when this process saw the job succeeded (polling every 1 ms), which adds
the batched acknowledgement. All in milliseconds. With ``--check``, exits 1 if the NOTIFY
pickup p50 is above 10 ms.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from _common import (
    JOB_BY_ID,
    percentile,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
)

TARGET_P50_MS = 10.0


def one_job(n: int) -> tuple[float, float, float]:
    """Enqueue one job and wait for it.

    Returns, in seconds after the commit: when the claim statement started (PostgreSQL's
    ``started_at``), when the handler started, and when this process saw the job succeeded.
    """
    from django.db import connection, transaction

    import jobs
    from bench.benchapp.jobs import Noop

    with transaction.atomic():
        enqueued = jobs.enqueue(Noop(n=n))
    committed = time.time()
    deadline = time.monotonic() + 10
    with connection.cursor() as cur:
        while True:
            cur.execute(JOB_BY_ID, {"id": enqueued.id})
            state, result, claimed = cur.fetchone()
            if state == "succeeded":
                seen = time.time()
                break
            if state not in ("queued", "running"):
                raise SystemExit(f"job {enqueued.id} ended {state}")
            if time.monotonic() > deadline:
                raise SystemExit(f"job {enqueued.id} did not finish within 10 s")
            time.sleep(0.001)
    if isinstance(result, str):  # jsonb may come back as text
        result = float(result)
    return float(claimed) - committed, result - committed, seen - committed


def measure(label: str, count: int, worker_args: list[str], pause: float) -> list[object]:
    truncate()
    with running_workers(1, ["--concurrency", "10", *worker_args]):
        time.sleep(1.0)  # let the listener connect and the first passes go by
        one_job(-1)  # warm up this process's code paths and connection
        claims, pickups, dones = [], [], []
        for n in range(count):
            time.sleep(random.uniform(0, pause))
            claim, pickup, done = one_job(n)
            claims.append(claim * 1000)
            pickups.append(pickup * 1000)
            dones.append(done * 1000)
    dispatch = [p - c for p, c in zip(pickups, claims, strict=True)]
    return [
        label,
        count,
        percentile(pickups, 50),
        percentile(pickups, 95),
        percentile(pickups, 99),
        max(pickups),
        percentile(claims, 50),
        percentile(dispatch, 50),
        percentile(dones, 50),
        percentile(dones, 99),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs with NOTIFY on")
    parser.add_argument("--jobs-no-listen", type=int, default=100, help="jobs with NOTIFY off")
    parser.add_argument("--poll", type=float, default=0.5, help="worker poll interval (s)")
    parser.add_argument("--check", action="store_true", help="exit 1 if below the target")
    args = parser.parse_args()
    setup_bench()
    poll = ["--poll-interval", str(args.poll)]
    rows = [measure("NOTIFY", args.jobs, poll, 0.02)]
    if args.jobs_no_listen:
        rows.append(measure("poll only", args.jobs_no_listen, [*poll, "--no-listen"], args.poll))
    truncate()
    print(
        table(
            [
                "mode",
                "jobs",
                "pickup p50 ms",
                "p95",
                "p99",
                "max",
                "→claim p50",
                "claim→handler p50",
                "done p50",
                "done p99",
            ],
            rows,
        )
    )
    p50 = rows[0][2]
    print(f"\npickup p50 with NOTIFY: {p50:.2f} ms, target ≤ {TARGET_P50_MS:g} ms")
    failed = report_problems()
    if args.check and p50 > TARGET_P50_MS:
        return 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
