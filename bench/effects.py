"""Time transactional completion and the effect journal against the worker's own outcome path.

    .venv/bin/python bench/effects.py [--jobs 2000] [--batch 50]

In a scratch database (``<db>_effects_bench``), with a one-row business write (an insert
into ``bench_business``) standing for the handler's own work. Every mode runs on freshly
claimed jobs, one round of each mode after the other so a noisy machine affects all alike:

* ``worker, alone``: the business write commits in its own transaction, then the job's
  outcome is written as a worker pass writes a lone outcome (one statement, autocommit);
* ``worker, batched``: the same, with the outcome's share of a ``--batch`` outcome write
  (the worker's usual pass when it is busy);
* ``complete()``: the business write and ``jobs.complete(ctx)`` in one transaction (the row
  locked, then the outcome statement with its rollup upsert; the worker writes nothing);
* ``effect_key()``: the key alone (it reads the row's creation time, once an attempt);
* ``effect().run``: a journaled effect whose call does nothing (the read, the intent and
  the result, each committed).

Prints the median and p95 per job (or per effect) in milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

from _setup import setup

NAME = "bench.effects.v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args()
    setup("_effects_bench")
    from datetime import timedelta

    from django.db import connection, transaction

    import jobs
    from jobs import JobContext
    from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome, claim, enqueue_many, record

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job, jobs_effect")
        cur.execute("CREATE TABLE IF NOT EXISTS bench_business (id bigserial PRIMARY KEY, n int)")
        cur.execute("TRUNCATE bench_business")

    def business() -> None:
        with connection.cursor() as cur:
            cur.execute("INSERT INTO bench_business (n) VALUES (1)")

    def context(job) -> JobContext:
        return JobContext(
            id=job.id,
            job_id=job.job_id,
            name=job.name,
            tenant=job.tenant,
            attempt=job.attempts,
            max_attempts=job.max_attempts,
            timeout=60.0,
            logger=logging.LoggerAdapter(logging.getLogger("bench"), {}),
            claim_token=job.claim_token,
        )

    def held(count: int) -> list:
        enqueue_many([NewJob(NAME) for _ in range(count)])
        return claim(
            [ClaimRequest(NAME, count)],
            scope=AllTenants(),
            lease=timedelta(hours=1),
            worker="bench",
        )

    def worker_alone(job) -> None:
        with transaction.atomic():
            business()
        assert record([Outcome.succeeded(job)], count=False).applied

    def complete(job) -> None:
        with transaction.atomic():
            business()
            jobs.complete(context(job))

    def effect(job) -> None:
        jobs.effect(context(job), "call").run(lambda key: None)

    def key(job) -> None:
        jobs.effect_key(context(job), "call")

    modes: dict[str, Callable] = {
        "worker, alone": worker_alone,
        "complete()": complete,
        "effect_key()": key,
        "effect().run": effect,
    }
    times: dict[str, list[float]] = {mode: [] for mode in [*modes, "worker, batched"]}
    chunk = args.batch
    for _ in range(max(1, args.jobs // chunk)):
        for mode, run in modes.items():
            for job in held(chunk):
                started = time.perf_counter()
                run(job)
                times[mode].append(time.perf_counter() - started)
        # The batched worker path: the business writes one by one, the outcomes in one write.
        batch = held(chunk)
        started = time.perf_counter()
        for _job in batch:
            with transaction.atomic():
                business()
        assert len(record([Outcome.succeeded(job) for job in batch], count=False).applied) == chunk
        times["worker, batched"].extend([(time.perf_counter() - started) / chunk] * chunk)
        with connection.cursor() as cur:
            cur.execute("DELETE FROM jobs_job WHERE state = 'succeeded'")

    print(f"per job, {len(times['complete()'])} jobs a mode, a one-row business write each (ms):")
    for mode in ["worker, alone", "worker, batched", "complete()", "effect_key()", "effect().run"]:
        seen = sorted(times[mode])
        print(
            f"  {mode:<16} median {statistics.median(seen) * 1000:6.3f}"
            f"  p95 {seen[int(len(seen) * 0.95)] * 1000:6.3f}"
        )


if __name__ == "__main__":
    main()
