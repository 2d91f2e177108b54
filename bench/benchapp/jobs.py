"""Job types the benchmarks run.

- ``bench.noop.v1``: does nothing;
- ``bench.touch.v1``: one ``SELECT 1`` on Django's connection;
- ``bench.append.v1``: one ``O_APPEND`` write of a line to the file named by
  ``BENCH_APPEND_FILE`` (the side-by-side benchmark's job: the same work for every queue);
- ``bench.sleep.v1`` / ``bench.asleep.v1``: wait ``ms`` milliseconds, in ``time.sleep`` and in
  an ``async def`` handler awaiting ``asyncio.sleep`` (handlers that wait on I/O);
- ``bench.tenants.v1`` / ``bench.fair.v1``: do nothing, the second with ``fair=True``
  (bench/fairness.py);
- ``bench.progress.v1`` / ``bench.effectkey.v1`` / ``bench.journal.v1`` /
  ``bench.complete.v1``: do nothing but report progress once, take an effect key, run one
  journaled effect whose call does nothing, or complete the job in their own transaction
  (bench/workflows.py's drain, each helper's cost against ``bench.noop.v1``);
- ``bench.gated.v1``: ``global_concurrency`` set, counts itself in and out of a table while it
  waits ``ms`` milliseconds; ``bench.rated.v1``: does nothing, ``rate_limit`` set
  (bench/flow.py).

Every handler returns ``time.time()`` taken as they start, which the worker stores as the job's
result, so the latency benchmark can compare the handler's start with the producer's commit
time on the same machine clock.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

import jobs
from jobs import JobContext, Payload, Rate, job


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


def _job_where(flag: str, payload_type: type[Payload], **options: Any) -> Callable[[Any], Any]:
    """``@job(payload_type, **options)`` where the environment sets ``flag`` to 1, else
    nothing: a worker claims every type registered, and a benchmark measuring the claim of
    its own types must not pay for types it does not run."""
    if os.environ.get(flag) == "1":
        return job(payload_type, **options)
    return lambda handler: handler


# The helpers' costs (bench/workflows.py sets BENCH_HELPERS=1 for itself and its workers).


class Progress(Payload, name="bench.progress.v1"):
    n: int = 0


class EffectKey(Payload, name="bench.effectkey.v1"):
    n: int = 0


class Journal(Payload, name="bench.journal.v1"):
    n: int = 0


class Complete(Payload, name="bench.complete.v1"):
    n: int = 0


@_job_where("BENCH_HELPERS", Progress, concurrency=100, timeout=60, max_attempts=3)
def progress(payload: Progress, ctx: JobContext) -> float:
    ctx.progress(1, 1, "done")
    return time.time()


@_job_where("BENCH_HELPERS", EffectKey, concurrency=100, timeout=60, max_attempts=3)
def effectkey(payload: EffectKey, ctx: JobContext) -> float:
    jobs.effect_key(ctx, "call")
    return time.time()


@_job_where("BENCH_HELPERS", Journal, concurrency=100, timeout=60, max_attempts=3)
def journal(payload: Journal, ctx: JobContext) -> float:
    return jobs.effect(ctx, "call").run(lambda key: time.time())


@_job_where("BENCH_HELPERS", Complete, concurrency=100, timeout=60, max_attempts=3)
def complete(payload: Complete, ctx: JobContext) -> None:
    with transaction.atomic():
        jobs.complete(ctx, time.time())


class Append(Payload, name="bench.append.v1"):
    n: int = 0


class Sleep(Payload, name="bench.sleep.v1"):
    n: int = 0
    ms: int = 50


class AsyncSleep(Payload, name="bench.asleep.v1"):
    n: int = 0
    ms: int = 50


# The side-by-side and I/O-bound types have no per-type ``concurrency``: a type's own limit
# counts prefetched jobs, so a limit of 100 made ``--prefetch`` hold nothing at
# ``--concurrency 100`` (the runs with it measured no prefetch at all).
@job(Append, timeout=60, max_attempts=3)
def append(payload: Append, ctx: JobContext) -> float:
    started = time.time()
    fd = os.open(os.environ["BENCH_APPEND_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"%d\n" % payload.n)
    finally:
        os.close(fd)
    return started


@job(Sleep, timeout=60, max_attempts=3)
def sleep(payload: Sleep, ctx: JobContext) -> float:
    started = time.time()
    time.sleep(payload.ms / 1000)
    return started


@job(AsyncSleep, timeout=60, max_attempts=3)
async def asleep(payload: AsyncSleep, ctx: JobContext) -> float:
    started = time.time()
    await asyncio.sleep(payload.ms / 1000)
    return started


# Flow control (bench/fairness.py, bench/flow.py). Two no-op types that differ only in
# ``fair``, so that a run with fairness off and one with it on drain the same work. The limits
# of the gated and rated types come from the environment (the scripts set it for themselves
# and their workers alike): ``BENCH_GLOBAL_CONCURRENCY`` (default 10) and ``BENCH_RATE``
# (starts per second, default 50). They are registered only where ``BENCH_FLOW=1`` (those two
# scripts set it): a worker that registers a limited type claims it in the flow form of the
# claim, which the other benchmarks, measuring types without controls, must not pay for.


class Tenants(Payload, name="bench.tenants.v1"):
    n: int = 0


class Fair(Payload, name="bench.fair.v1"):
    n: int = 0


@_job_where("BENCH_FLOW", Tenants, concurrency=100, timeout=60, max_attempts=3)
def tenants(payload: Tenants, ctx: JobContext) -> float:
    return time.time()


@_job_where("BENCH_FLOW", Fair, concurrency=100, timeout=60, max_attempts=3, fair=True)
def fair(payload: Fair, ctx: JobContext) -> float:
    return time.time()


#: The table the gated handler counts itself in (created by bench/flow.py): one row per
#: type, ``cur`` handlers inside now and ``peak`` the most ever seen inside at once.
GAUGE_TABLE = "bench_flow_gauge"


class Gated(Payload, name="bench.gated.v1"):
    n: int = 0
    ms: int = 20


@_job_where(
    "BENCH_FLOW",
    Gated,
    timeout=60,
    max_attempts=3,
    global_concurrency=int(os.environ.get("BENCH_GLOBAL_CONCURRENCY", "10")),
)
def gated(payload: Gated, ctx: JobContext) -> float:
    """Count itself in on entry and out on exit, each in its own autocommit statement on
    Django's connection, and wait ``ms`` in between: the gauge's peak is the most handlers
    of the type that were ever inside at once, across every worker."""
    started = time.time()
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE {GAUGE_TABLE} SET cur = cur + 1, peak = GREATEST(peak, cur + 1) "
            "WHERE name = %s",
            [Gated.job_name],
        )
        try:
            time.sleep(payload.ms / 1000)
        finally:
            cur.execute(f"UPDATE {GAUGE_TABLE} SET cur = cur - 1 WHERE name = %s", [Gated.job_name])
    return started


class Rated(Payload, name="bench.rated.v1"):
    n: int = 0


@_job_where(
    "BENCH_FLOW",
    Rated,
    concurrency=100,
    timeout=60,
    max_attempts=3,
    rate_limit=Rate(int(os.environ.get("BENCH_RATE", "50")), per=1),
)
def rated(payload: Rated, ctx: JobContext) -> float:
    return time.time()
