"""pgqueuer's side of ``bench/versus.py``: its worker and a client agent (own venv, own database).

Runs under ``.venv-versus`` (``requirements/bench-versus.txt``: pgqueuer with asyncpg and
uvloop), never under the project's venv, and imports nothing from the project. Two commands:

``worker``: one pgqueuer worker process, a ``QueueManager`` on asyncpg under uvloop, as ``pgq
run`` sets it up (``uvloop.run``; the ``SchedulerManager`` of ``PgQueuer`` is left out: no
schedules are registered). Its entrypoints do the work of ``bench.append.v1``: ``bench.append``
decodes the JSON payload and makes one ``O_APPEND`` write of ``n`` to ``BENCH_APPEND_FILE``;
``bench.latency`` writes ``n`` and the handler's ``time.time()`` at start to
``BENCH_LATENCY_FILE``. Logs ``pgqueuer worker PID started: …`` on stderr right before
``QueueManager.run`` (the line ``_common.WorkerProcess`` waits for); SIGTERM shuts it down
(pgqueuer flushes its buffered acknowledgements on the way out).

``agent``: the producer, one asyncpg connection, driven by JSON lines on stdin (one JSON reply
per line on stdout): ``connect``, ``install``, ``reset`` (truncate the queue and its log,
vacuum), ``enqueue`` (``single``: one ``Queries.enqueue`` call per job, each its own
transaction; ``bulk``: one list enqueue of them all; ``batches``: lists of 1,000, to fill the
queue before a drain), ``latency`` (one job at a time into an idle worker) and ``close``.
Payloads are built before the clock starts and encoded (``json.dumps``) inside it, as
``jobs.enqueue`` encodes its payload objects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta

import asyncpg
import uvloop
from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver, Queries, QueueManager
from pgqueuer.models import Job

APPEND = "bench.append"
LATENCY = "bench.latency"
FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, FLAGS, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _connect_args(dsn: dict) -> dict:
    """asyncpg.connect keyword arguments from the bench's {host, port, user, password, database}
    (a host that starts with ``/`` is a Unix socket directory)."""
    return {key: value for key, value in dsn.items() if value not in (None, "")}


# --- worker ---------------------------------------------------------------------------------


async def worker(args: argparse.Namespace) -> None:
    dsn = _connect_args(json.loads(args.dsn))
    pool = None
    if args.driver == "pool":
        pool = await asyncpg.create_pool(min_size=args.pool_size, max_size=args.pool_size, **dsn)
        driver = AsyncpgPoolDriver(pool)
    else:
        connection = await asyncpg.connect(**dsn)
        driver = AsyncpgDriver(connection)
    qm = QueueManager(Queries(driver))
    append_file = os.environ["BENCH_APPEND_FILE"]
    latency_file = os.environ.get("BENCH_LATENCY_FILE", append_file)

    @qm.entrypoint(APPEND)
    async def append(job: Job) -> None:
        assert job.payload is not None
        _write(append_file, b"%d\n" % json.loads(job.payload)["n"])

    @qm.entrypoint(LATENCY)
    async def latency(job: Job) -> None:
        started = time.time()
        assert job.payload is not None
        _write(latency_file, b"%d %.6f\n" % (json.loads(job.payload)["n"], started))

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, qm.shutdown.set)
    print(
        f"pgqueuer worker {os.getpid()} started: batch_size={args.batch_size} "
        f"max_concurrent_tasks={args.max_concurrent_tasks} driver={args.driver}",
        file=sys.stderr,
        flush=True,
    )
    try:
        await qm.run(
            batch_size=args.batch_size,
            max_concurrent_tasks=args.max_concurrent_tasks,
            dequeue_timeout=timedelta(seconds=args.dequeue_timeout),
        )
    finally:
        if pool is not None:
            await pool.close()
        else:
            await connection.close()


# --- agent ----------------------------------------------------------------------------------


class Agent:
    def __init__(self) -> None:
        self.connection: asyncpg.Connection | None = None
        self.queries: Queries | None = None

    @property
    def q(self) -> Queries:
        assert self.queries is not None, "connect first"
        return self.queries

    @property
    def conn(self) -> asyncpg.Connection:
        assert self.connection is not None, "connect first"
        return self.connection

    async def connect(self, dsn: dict) -> dict:
        if self.connection is not None:
            await self.connection.close()
        self.connection = await asyncpg.connect(**_connect_args(dsn))
        self.queries = Queries(AsyncpgDriver(self.connection))
        return {"backend": await self.conn.fetchval("SELECT pg_backend_pid()")}

    async def install(self) -> dict:
        if await self.q.has_table(self.q.qbe.settings.queue_table):
            await self.q.upgrade()
            return {"installed": False}
        await self.q.install()
        return {"installed": True}

    async def reset(self) -> dict:
        await self.conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
        await self.conn.execute("VACUUM ANALYZE pgqueuer")
        return {}

    async def vacuum(self) -> dict:
        await self.conn.execute("VACUUM ANALYZE pgqueuer")
        return {}

    async def enqueue(self, count: int, mode: str, entrypoint: str = APPEND) -> dict:
        items = [{"n": i} for i in range(count)]
        cpu = time.process_time()
        started = time.perf_counter()
        if mode == "single":
            for item in items:
                await self.q.enqueue(entrypoint, json.dumps(item).encode())
        elif mode in ("bulk", "batches"):
            size = count if mode == "bulk" else 1000
            for first in range(0, count, size):
                chunk = items[first : first + size]
                await self.q.enqueue(
                    [entrypoint] * len(chunk),
                    [json.dumps(item).encode() for item in chunk],
                    [0] * len(chunk),
                )
        else:
            raise ValueError(f"unknown enqueue mode {mode!r}")
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        queued = await self.conn.fetchval("SELECT count(*) FROM pgqueuer WHERE status = 'queued'")
        return {"elapsed": elapsed, "cpu": cpu, "queued": queued}

    async def latency(self, count: int, pause: float, file: str) -> dict:
        """Enqueue ``count`` jobs one at a time (after a random pause of up to ``pause`` s),
        each waited for; returns per job, in ms after the enqueue's commit: the claim
        statement (the log's ``picked`` row, PostgreSQL's clock), the handler's start, and when
        this agent saw the job ``successful`` in the log (polling every 1 ms)."""
        offset = os.path.getsize(file) if os.path.exists(file) else 0
        claims, pickups, dones = [], [], []
        for n in range(-1, count):  # -1: warm-up, not counted
            await asyncio.sleep(random.uniform(0, pause))
            (job_id,) = await self.q.enqueue(LATENCY, json.dumps({"n": n}).encode())
            committed = time.time()
            deadline = time.monotonic() + 10
            while True:
                rows = await self.conn.fetch(
                    "SELECT status::text, extract(epoch FROM created)::float8 "
                    "FROM pgqueuer_log WHERE job_id = $1",
                    job_id,
                )
                seen = dict(rows)
                if "successful" in seen:
                    done = time.time()
                    break
                if {"exception", "canceled", "failed", "deleted"} & seen.keys():
                    raise SystemExit(f"pgqueuer job {job_id} ended {sorted(seen)}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"pgqueuer job {job_id} did not finish within 10 s")
                await asyncio.sleep(0.001)
            with open(file, "rb") as lines:
                lines.seek(offset)
                written = lines.read()
            offset += len(written)
            marks = {int(a): float(b) for a, b in (line.split() for line in written.splitlines())}
            if n < 0:
                continue
            claims.append((seen["picked"] - committed) * 1000)
            pickups.append((marks[n] - committed) * 1000)
            dones.append((done - committed) * 1000)
        return {"claim": claims, "pickup": pickups, "done": dones}

    async def close(self) -> dict:
        if self.connection is not None:
            await self.connection.close()
            self.connection = None
        return {}


def agent() -> None:
    """Serve JSON commands from stdin, one per line: {"op": NAME, ...arguments}."""
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    state = Agent()
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            result = loop.run_until_complete(getattr(state, op)(**command))
            reply = {"ok": True, **result}
        except (Exception, SystemExit) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
        if op == "close":
            break
    loop.run_until_complete(state.close())
    loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("worker")
    run.add_argument("--dsn", required=True, help="JSON: host, port, user, password, database")
    run.add_argument("--batch-size", type=int, default=10)
    run.add_argument("--max-concurrent-tasks", type=int, default=None)
    run.add_argument("--dequeue-timeout", type=float, default=30.0)
    run.add_argument("--driver", choices=["conn", "pool"], default="conn")
    run.add_argument("--pool-size", type=int, default=4)
    sub.add_parser("agent")
    args = parser.parse_args()
    if args.command == "worker":
        uvloop.run(worker(args))
    else:
        agent()


if __name__ == "__main__":
    main()
