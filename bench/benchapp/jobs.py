"""Job types the benchmarks run: a no-op, and one that makes a single database query.

Both handlers return ``time.time()`` taken as they start, which the worker stores as the job's
result, so the latency benchmark can compare the handler's start with the producer's commit
time on the same machine clock.
"""

from __future__ import annotations

import time

from django.db import connection

from jobs import JobContext, Payload, job


class Noop(Payload, name="bench.noop.v1"):
    n: int = 0


class Touch(Payload, name="bench.touch.v1"):
    """Like Noop, but the handler runs ``SELECT 1`` on Django's connection (a typical handler
    touches the database; this shows what the pool's connection handling costs per job)."""

    n: int = 0


@job(Noop, concurrency=100, timeout=60, max_attempts=3)
def noop(payload: Noop, ctx: JobContext) -> float:
    return time.time()


@job(Touch, concurrency=100, timeout=60, max_attempts=3)
def touch(payload: Touch, ctx: JobContext) -> float:
    started = time.time()
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
        cur.fetchone()
    return started
