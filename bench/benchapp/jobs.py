"""Job types the benchmarks run.

- ``bench.noop.v1``: does nothing;
- ``bench.touch.v1``: one ``SELECT 1`` on Django's connection;
- ``bench.append.v1``: one ``O_APPEND`` write of a line to the file named by
  ``BENCH_APPEND_FILE`` (the side-by-side benchmark's job: the same work for every queue);
- ``bench.sleep.v1`` / ``bench.asleep.v1``: wait ``ms`` milliseconds, in ``time.sleep`` and in
  an ``async def`` handler awaiting ``asyncio.sleep`` (handlers that wait on I/O).

Every handler returns ``time.time()`` taken as they start, which the worker stores as the job's
result, so the latency benchmark can compare the handler's start with the producer's commit
time on the same machine clock.
"""

from __future__ import annotations

import asyncio
import os
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


class Append(Payload, name="bench.append.v1"):
    n: int = 0


class Sleep(Payload, name="bench.sleep.v1"):
    n: int = 0
    ms: int = 50


class AsyncSleep(Payload, name="bench.asleep.v1"):
    n: int = 0
    ms: int = 50


@job(Append, concurrency=100, timeout=60, max_attempts=3)
def append(payload: Append, ctx: JobContext) -> float:
    started = time.time()
    fd = os.open(os.environ["BENCH_APPEND_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"%d\n" % payload.n)
    finally:
        os.close(fd)
    return started


@job(Sleep, concurrency=100, timeout=60, max_attempts=3)
def sleep(payload: Sleep, ctx: JobContext) -> float:
    started = time.time()
    time.sleep(payload.ms / 1000)
    return started


@job(AsyncSleep, concurrency=100, timeout=60, max_attempts=3)
async def asleep(payload: AsyncSleep, ctx: JobContext) -> float:
    started = time.time()
    await asyncio.sleep(payload.ms / 1000)
    return started
