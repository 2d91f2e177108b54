"""Side by side: ``jobs`` against pgqueuer, the same measurements on the same PostgreSQL.

    .venv/bin/python bench/versus.py [--transport tcp|unix|both] [--runs 3] [--quick]
                                     [--jobs 10000] [--single 2000] [--latency-jobs 200]
    .venv/bin/python bench/versus.py --pgq-sweep      # pgqueuer's 2-process configurations
    .venv/bin/python bench/versus.py --statements     # statements per job (pg_stat_statements)
    .venv/bin/python bench/versus.py --only drain1 drain2   # some of the measurements

pgqueuer is a bench-only dependency: its pinned set (``requirements/bench-versus.txt``) is
installed on first use into a venv of its own, ``.venv-versus`` (git-ignored), so the project's
venv stays what CI installs. Its side runs there (``bench/_versus_pgq.py``): the workers (a
``QueueManager`` on one asyncpg connection under uvloop) and a producer agent this script
drives over a pipe. Each system has its own database on the same server: ``<db>_bench`` for
``jobs`` (``manage.py runworker`` processes, ``DJANGO_SETTINGS_MODULE=bench.settings``) and
``<db>_versus_pgq`` for pgqueuer's schema. Both run the same job: one ``O_APPEND`` write of the
job's number to a file (``bench.append.v1``; pgqueuer's ``bench.append`` entrypoint), counted
afterwards.

Connections: ``--transport tcp`` (the default; 127.0.0.1, as production connects) or ``unix``
(the Unix socket, whose round trips are cheaper), or ``both``. With DATABASE_URL unset the
script starts a PostgreSQL of its own for the run (``_versus_server.py``: the embedded
server's binaries, a temporary data directory, listening on 127.0.0.1 and a socket; the
development server listens on a socket only) and stops it at the end. With DATABASE_URL set it
is used as given, and the transport is whatever that URL names.

Measurements, each for both systems in turn (jobs, pgqueuer, jobs, pgqueuer, …; every
measurement runs on each transport before the next), ``--runs`` times (default 3), median:

- ``single``: ``--single`` jobs (2,000) enqueued one by one, each its own transaction
  (``jobs.enqueue`` and pgqueuer's ``Queries.enqueue``, each one autocommitted statement);
- ``single_prepared``: the same, with ``jobs`` set to prepare its statements
  (``JOBS["PREPARED_STATEMENTS"] = True``, for a project that connects directly), as asyncpg
  always does for pgqueuer;
- ``bulk``: ``--jobs`` (10,000) in one call (``jobs.enqueue_many``; ``Queries.enqueue`` of
  lists), jobs/s and client + PostgreSQL CPU µs per job;
- ``drain``: ``--jobs`` jobs queued beforehand (in batches of 1,000, then VACUUM ANALYZE), run by
  1 worker process at its defaults (``runworker``: 20 handler threads; pgqueuer: ``batch_size``
  10, no task cap) and by 2 at the best configuration found (``JOBS_BEST``, see
  ``--jobs-sweep``; pgqueuer: ``BEST_PGQ``, see ``--pgq-sweep``). jobs/s from the workers'
  "started" lines until a poll (every 10 ms) finds no job left; worker and PostgreSQL CPU µs
  per job as in ``drain.py``, for the backends of both databases;
- ``latency``: idle pickup, one job at a time into 1 worker at its defaults, with
  LISTEN/NOTIFY, as ``latency.py``: the handler's ``time.time()`` at start minus the
  producer's right after its commit; p50 and p99 over ``--latency-jobs`` (200).

Every drain is checked: every jobs job succeeded, pgqueuer's log has one ``successful`` entry
per job and nothing failed, and the handlers' file holds one line per job, none twice. The
script exits non-zero if a job is lost, fails or runs twice, or a worker exits badly; every
worker process is stopped (SIGTERM, then SIGKILL after 30 s) whatever happens. ``--quick``:
500 jobs, 200 single, 50 latency jobs, 1 run (a smoke run).

``--pgq-sweep`` drains ``--jobs`` jobs with 2 pgqueuer workers in each configuration of
``SWEEP`` (batch size, task cap, one connection or a pool), ``--runs`` times, and prints them;
``--jobs-sweep`` does the same with 2 ``runworker`` processes in each of ``JOBS_SWEEP``
(handler threads, ``--prefetch``).
``--statements`` starts the server with pg_stat_statements (``track_planning`` on; own server
only) and prints, for each system, the statements behind enqueues one by one and a 2-process
drain: calls per job, rows and plans per call, planning and execution µs per call, µs per job
(full texts in ``var/bench/versus-statements.txt``); no throughput table then (the extension
costs time on every statement).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import psutil
from _common import (
    JOB_BY_ID,
    PostgresCpu,
    WorkerProcess,
    counts,
    enqueue_noops,
    out_path,
    percentile,
    problems,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
    wait_started,
    wait_until_done,
)
from _setup import ROOT, _create_database
from _versus_server import BenchServer

VENV = ROOT / ".venv-versus"
VENV_PYTHON = VENV / "bin" / "python"
REQUIREMENTS = ROOT / "requirements" / "bench-versus.txt"
PGQ_SCRIPT = Path(__file__).resolve().parent / "_versus_pgq.py"
PGQ_SUFFIX = "_versus_pgq"

#: pgqueuer's queue is empty once every job is acknowledged (the ack deletes the row).
PGQ_UNFINISHED = "SELECT EXISTS (SELECT 1 FROM pgqueuer)"
# Untimed enqueues before each enqueue measurement, by the same calls: enough for a bulk
# warm-up to take the path of a large batch (COPY, from 64 jobs on).
WARM_UP = 100

MEASUREMENTS = ("single", "single_prepared", "bulk", "drain1", "drain2", "latency")
JOBS_DEFAULT: list[str] = []  # runworker at its defaults: 20 handler threads
#: The best of ``JOBS_SWEEP`` with 2 processes on a 2-core machine (``--jobs-sweep``): 200
#: handler threads and up to 200 jobs held beyond them. In three sweeps of 5 and 3 runs it
#: drained 21,200-26,300 jobs/s, against 19,000-23,000 at ``--concurrency 100``; the larger
#: configurations below were within the noise of it.
JOBS_BEST = ["--concurrency", "200", "--prefetch", "200"]
#: ``runworker`` configurations for ``--jobs-sweep``: handler threads, and jobs held beyond
#: them (``--prefetch``).
JOBS_SWEEP = [
    ["--concurrency", "20"],
    ["--concurrency", "100"],
    ["--concurrency", "200"],
    ["--concurrency", "100", "--prefetch", "100"],
    ["--concurrency", "200", "--prefetch", "200"],
    ["--concurrency", "400", "--prefetch", "200"],
    ["--concurrency", "200", "--prefetch", "800"],
    ["--concurrency", "400", "--prefetch", "400"],
]


@dataclass(frozen=True)
class PgqConfig:
    """A pgqueuer worker's options (``QueueManager.run`` and the driver)."""

    batch_size: int = 10  # QueueManager.run's and `pgq run`'s default
    max_concurrent_tasks: int | None = None  # None: no cap (the default)
    driver: str = "conn"  # "conn": AsyncpgDriver, one connection; "pool": AsyncpgPoolDriver
    pool_size: int = 4

    def args(self) -> list[str]:
        args = ["--batch-size", str(self.batch_size), "--driver", self.driver]
        if self.max_concurrent_tasks:
            args += ["--max-concurrent-tasks", str(self.max_concurrent_tasks)]
        if self.driver == "pool":
            args += ["--pool-size", str(self.pool_size)]
        return args

    def label(self) -> str:
        parts = [f"batch_size {self.batch_size}"]
        if self.max_concurrent_tasks:
            parts.append(f"max_concurrent_tasks {self.max_concurrent_tasks}")
        parts.append("one connection" if self.driver == "conn" else f"pool of {self.pool_size}")
        return ", ".join(parts)


PGQ_DEFAULT = PgqConfig()
#: The best of ``SWEEP`` with 2 processes on a 2-core machine (``--pgq-sweep``): batches of 500,
#: no task cap, on one connection (27,100-32,400 jobs/s in sweeps of 5 and 3 runs; batches of
#: 200, 26,700-29,200; batches of 50 with 200 tasks, the best of an earlier sweep without the
#: larger batches, 21,200-22,600). The larger the batch, the fewer claims and acknowledgements
#: per job: PostgreSQL's CPU a job fell from 40 to 24 µs.
BEST_PGQ = PgqConfig(batch_size=500)
SWEEP = [
    PGQ_DEFAULT,
    PgqConfig(batch_size=50),
    PgqConfig(batch_size=200),
    PgqConfig(batch_size=10, max_concurrent_tasks=100),
    PgqConfig(batch_size=50, max_concurrent_tasks=100),
    PgqConfig(batch_size=50, max_concurrent_tasks=200),
    PgqConfig(batch_size=100, max_concurrent_tasks=200),
    PgqConfig(batch_size=100, max_concurrent_tasks=500),
    PgqConfig(batch_size=500),
    PgqConfig(batch_size=200, max_concurrent_tasks=500),
    PgqConfig(batch_size=200, max_concurrent_tasks=1000),
    PgqConfig(batch_size=500, max_concurrent_tasks=1000),
    PgqConfig(batch_size=50, max_concurrent_tasks=200, driver="pool"),
]


# --- the pgqueuer venv and agent --------------------------------------------------------------


def ensure_venv() -> None:
    """Create ``.venv-versus`` with the pinned set, or bring it up to date with the file."""
    marker = VENV / ".bench-versus.txt"
    wanted = REQUIREMENTS.read_text()
    if VENV_PYTHON.exists() and marker.exists() and marker.read_text() == wanted:
        return
    print(f"installing {REQUIREMENTS.relative_to(ROOT)} into {VENV.name}/ …", file=sys.stderr)
    if not VENV_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
    marker.write_text(wanted)


def venv_versions() -> str:
    code = (
        "import importlib.metadata as m; "
        "print(', '.join(f'{p} {m.version(p)}' for p in ('pgqueuer', 'asyncpg', 'uvloop')))"
    )
    return subprocess.run(
        [str(VENV_PYTHON), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


class Agent:
    """pgqueuer's producer (``_versus_pgq.py agent``), one JSON command per line."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(
            [str(VENV_PYTHON), str(PGQ_SCRIPT), "agent"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def call(self, op: str, **arguments: object) -> dict:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.popen.stdin.flush()
        line = self.popen.stdout.readline()
        if not line:
            raise SystemExit(f"pgqueuer agent exited ({self.popen.wait()}) during {op}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise SystemExit(f"pgqueuer agent, {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.popen.poll() is None:
            with suppress(OSError, SystemExit, ValueError):
                self.call("close")
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_pgq_worker(dsn: dict, config: PgqConfig, env: dict[str, str]) -> WorkerProcess:
    command = [str(VENV_PYTHON), str(PGQ_SCRIPT), "worker", "--dsn", json.dumps(dsn)]
    command += config.args()
    popen = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = WorkerProcess(command, popen)
    threading.Thread(target=worker._read, daemon=True).start()
    return worker


@contextmanager
def running_pgq_workers(
    count: int, dsn: dict, config: PgqConfig, env: dict[str, str]
) -> Iterator[list[WorkerProcess]]:
    """Start ``count`` pgqueuer workers, wait for their "started" lines; always stop them."""
    workers: list[WorkerProcess] = []
    try:
        for _ in range(count):
            workers.append(start_pgq_worker(dsn, config, env))
        wait_started(workers, 60)
        yield workers
    finally:
        for worker in workers:
            code = worker.stop()
            if code != 0:
                problems.append(
                    f"pgqueuer worker {worker.popen.pid} ({config.label()}) exited {code} "
                    f"when stopped:\n{worker.tail()}"
                )


# --- connections and CPU ----------------------------------------------------------------------


class ServerCpu(PostgresCpu):
    """``PostgresCpu`` over the backends of both bench databases, less the script's own."""

    def __init__(self, databases: tuple[str, ...]) -> None:
        super().__init__()
        self.databases = databases
        self.excluded: set[int] = set()
        if self.own_backend is not None:
            self.excluded.add(self.own_backend.pid)

    def _ours(self, proc: psutil.Process) -> bool:
        title = " ".join(proc.cmdline()).removeprefix("postgres: ")
        padded = f" {title} "
        return any(f" {name} " in padded for name in self.databases) or title.startswith(
            self._BACKGROUND
        )

    def total(self, *, exclude_self: bool = False) -> float:
        """CPU seconds so far; ``exclude_self`` leaves out this script's backends (Django's
        and the pgqueuer poller's), idle or polling, never the measured work."""
        if self.postmaster is None:
            return float("nan")
        by_pid = self.backends()
        if exclude_self:
            for pid in self.excluded:
                by_pid.pop(pid, None)
        t = self.postmaster.cpu_times()
        return sum(by_pid.values()) + t.user + t.system + t.children_user + t.children_system


def url_kind(url: str) -> str:
    host = unquote(urlsplit(url).hostname or "")
    return "unix" if not host or host.startswith("/") else "tcp"


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def asyncpg_dsn(url: str) -> dict:
    import environ

    cfg = environ.Env.db_url_config(url)
    return {
        "host": unquote(cfg["HOST"]) or None,
        "port": int(cfg["PORT"] or 5432),
        "user": cfg["USER"] or None,
        "password": cfg["PASSWORD"] or None,
        "database": cfg["NAME"],
    }


class Context:
    """Both systems' connections on one transport, switched with ``use``."""

    def __init__(self, bases: dict[str, str], jobs_db: str, pgq_db: str, agent: Agent) -> None:
        self.bases = bases  # transport -> base DATABASE_URL
        self.jobs_db, self.pgq_db = jobs_db, pgq_db
        self.agent = agent
        self.transport = ""
        self.poll = None  # psycopg connection to the pgqueuer database
        self.cpu: ServerCpu | None = None
        self.pgq_dsn: dict = {}
        self.files = {
            name: out_path(f"versus-{name}.log")
            for name in ("jobs", "pgq", "jobs-latency", "pgq-latency")
        }

    def use(self, transport: str) -> None:
        if transport == self.transport:
            return
        import environ
        import psycopg
        from django.db import connection

        jobs_url = with_database(self.bases[transport], self.jobs_db)
        cfg = environ.Env.db_url_config(jobs_url)
        connection.close()
        connection.settings_dict["HOST"] = unquote(cfg["HOST"])
        connection.settings_dict["PORT"] = cfg["PORT"]
        os.environ["DATABASE_URL"] = jobs_url  # what the jobs workers connect to
        self.pgq_dsn = asyncpg_dsn(with_database(self.bases[transport], self.pgq_db))
        if self.poll is not None:
            self.poll.close()
        dsn = self.pgq_dsn
        self.poll = psycopg.connect(
            host=dsn["host"],
            port=dsn["port"],
            user=dsn["user"],
            password=dsn["password"],
            dbname=dsn["database"],
            autocommit=True,
        )
        self.agent.call("connect", dsn=self.pgq_dsn)
        self.cpu = ServerCpu((self.jobs_db, self.pgq_db))
        self.cpu.excluded.add(self.poll.info.backend_pid)
        self.transport = transport

    def close(self) -> None:
        if self.poll is not None:
            self.poll.close()
            self.poll = None

    def env(self, append: str) -> dict[str, str]:
        return {
            "BENCH_APPEND_FILE": str(self.files[append]),
            "BENCH_LATENCY_FILE": str(self.files["pgq-latency"]),
        }

    def clear(self, name: str) -> None:
        self.files[name].write_bytes(b"")

    def check_lines(self, name: str, expected: int) -> None:
        lines = self.files[name].read_bytes().splitlines()
        if len(lines) != expected or len(set(lines)) != expected:
            raise SystemExit(
                f"{name}: the handlers wrote {len(lines)} lines ({len(set(lines))} distinct), "
                f"expected {expected}: a job was lost or ran twice"
            )


# --- jobs -------------------------------------------------------------------------------------


def jobs_enqueue(
    ctx: Context, count: int, bulk: bool, ready: Callable | None = None, prepared: bool = False
) -> dict:
    if prepared:
        with prepared_statements():
            return jobs_enqueue(ctx, count, bulk, ready)
    import jobs
    from bench.benchapp.jobs import Append

    assert ctx.cpu is not None
    truncate()
    # The same calls untimed first (a fresh connection's first statements cost more), as for
    # pgqueuer.
    if bulk:
        jobs.enqueue_many([Append(n=n) for n in range(WARM_UP)])
    else:
        for n in range(WARM_UP):
            jobs.enqueue(Append(n=n))
    truncate()
    vacuum()
    payloads = [Append(n=i) for i in range(count)]
    if ready is not None:
        ready()
    pg_before = ctx.cpu.total()
    cpu_before = time.process_time()
    started = time.perf_counter()
    if bulk:
        jobs.enqueue_many(payloads)
    else:
        for payload in payloads:
            jobs.enqueue(payload)
    elapsed = time.perf_counter() - started
    client = time.process_time() - cpu_before
    pg = ctx.cpu.total() - pg_before
    found = counts().get("queued", 0)
    if found != count:
        raise SystemExit(f"jobs enqueue: expected {count} queued jobs, found {found}")
    return {"rate": count / elapsed, "own": client * 1e6 / count, "pg": pg * 1e6 / count}


@contextmanager
def prepared_statements() -> Iterator[None]:
    """``JOBS["PREPARED_STATEMENTS"]`` on meanwhile, on a fresh connection."""
    from django.conf import settings
    from django.db import connection
    from django.test import override_settings

    connection.close()
    try:
        with override_settings(JOBS={**getattr(settings, "JOBS", {}), "PREPARED_STATEMENTS": True}):
            yield
    finally:
        connection.close()


def jobs_drain(
    ctx: Context, count: int, processes: int, args: list[str], ready: Callable | None = None
) -> dict:
    assert ctx.cpu is not None
    truncate()
    enqueue_noops(count, kind="append")
    vacuum()
    ctx.clear("jobs")
    if ready is not None:
        ready()  # the queue is full, no worker runs yet
    with running_workers(processes, args, env=ctx.env("jobs")) as workers:
        pg_before = ctx.cpu.total(exclude_self=True)
        started = min(w.started_at for w in workers)
        finished = wait_until_done(count, timeout=300)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg = ctx.cpu.total(exclude_self=True) - pg_before
    ctx.check_lines("jobs", count)
    return {
        "rate": count / (finished - started),
        "own": worker_cpu * 1e6 / count,
        "pg": pg * 1e6 / count,
    }


def jobs_one(n: int) -> tuple[float, float, float]:
    """One job into an idle worker (as ``latency.one_job``, with ``bench.append.v1``)."""
    from django.db import connection

    import jobs
    from bench.benchapp.jobs import Append

    enqueued = jobs.enqueue(Append(n=n))
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
                raise SystemExit(f"jobs job {enqueued.id} ended {state}")
            if time.monotonic() > deadline:
                raise SystemExit(f"jobs job {enqueued.id} did not finish within 10 s")
            time.sleep(0.001)
    if isinstance(result, str):
        result = float(result)
    return (
        (float(claimed) - committed) * 1000,
        (result - committed) * 1000,
        (seen - committed) * 1000,
    )


def jobs_latency(ctx: Context, count: int, pause: float) -> dict:
    truncate()
    ctx.clear("jobs-latency")
    with running_workers(1, JOBS_DEFAULT, env=ctx.env("jobs-latency")):
        time.sleep(1.0)  # let the listener connect and the first passes go by
        jobs_one(-1)
        marks = []
        for n in range(count):
            time.sleep(random.uniform(0, pause))
            marks.append(jobs_one(n))
    claims, pickups, dones = (list(column) for column in zip(*marks, strict=True))
    return latency_figures(claims, pickups, dones)


# --- pgqueuer ---------------------------------------------------------------------------------


def pgq_enqueue(ctx: Context, count: int, bulk: bool, ready: Callable | None = None) -> dict:
    assert ctx.cpu is not None
    mode = "bulk" if bulk else "single"
    ctx.agent.call("enqueue", count=WARM_UP, mode=mode)  # untimed, as for jobs
    ctx.agent.call("reset")
    if ready is not None:
        ready()
    pg_before = ctx.cpu.total()
    result = ctx.agent.call("enqueue", count=count, mode=mode)
    pg = ctx.cpu.total() - pg_before
    if result["queued"] != count:
        raise SystemExit(f"pgqueuer enqueue: expected {count} queued, found {result['queued']}")
    return {
        "rate": count / result["elapsed"],
        "own": result["cpu"] * 1e6 / count,
        "pg": pg * 1e6 / count,
    }


def pgq_statuses(ctx: Context) -> dict[str, int]:
    assert ctx.poll is not None
    rows = ctx.poll.execute(
        "SELECT status::text, count(*) FROM pgqueuer_log GROUP BY status"
    ).fetchall()
    return dict(rows)


def pgq_wait_until_done(ctx: Context, timeout: float) -> float:
    assert ctx.poll is not None
    deadline = time.monotonic() + timeout
    while True:
        (unfinished,) = ctx.poll.execute(PGQ_UNFINISHED).fetchone()
        now = time.monotonic()
        if not unfinished:
            return now
        if now > deadline:
            raise SystemExit(f"pgqueuer: timed out with jobs not finished: {pgq_statuses(ctx)}")
        time.sleep(0.01)


def pgq_drain(
    ctx: Context, count: int, processes: int, config: PgqConfig, ready: Callable | None = None
) -> dict:
    assert ctx.cpu is not None
    ctx.agent.call("reset")
    ctx.agent.call("enqueue", count=count, mode="batches")
    ctx.agent.call("vacuum")
    ctx.clear("pgq")
    if ready is not None:
        ready()
    with running_pgq_workers(processes, ctx.pgq_dsn, config, ctx.env("pgq")) as workers:
        pg_before = ctx.cpu.total(exclude_self=True)
        started = min(w.started_at for w in workers)
        finished = pgq_wait_until_done(ctx, timeout=300)
        worker_cpu = sum(w.cpu() - w.cpu_at_start for w in workers)
        pg = ctx.cpu.total(exclude_self=True) - pg_before
    found = pgq_statuses(ctx)
    bad = {k: v for k, v in found.items() if k not in ("queued", "picked", "successful")}
    if found.get("successful", 0) != count or bad:
        raise SystemExit(f"pgqueuer: expected {count} successful jobs, the log has {found}")
    ctx.check_lines("pgq", count)
    return {
        "rate": count / (finished - started),
        "own": worker_cpu * 1e6 / count,
        "pg": pg * 1e6 / count,
    }


def pgq_latency(ctx: Context, count: int, pause: float) -> dict:
    ctx.agent.call("reset")
    ctx.clear("pgq-latency")
    with running_pgq_workers(1, ctx.pgq_dsn, PGQ_DEFAULT, ctx.env("pgq")):
        time.sleep(1.0)
        result = ctx.agent.call(
            "latency", count=count, pause=pause, file=str(ctx.files["pgq-latency"])
        )
    return latency_figures(result["claim"], result["pickup"], result["done"])


def latency_figures(claims: list[float], pickups: list[float], dones: list[float]) -> dict:
    return {
        "p50": percentile(pickups, 50),
        "p99": percentile(pickups, 99),
        "claim": percentile(claims, 50),
        "done": percentile(dones, 50),
    }


# --- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    key: str
    label: str
    jobs: Callable[[Context], dict]
    pgq: Callable[[Context], dict]


def measurements(args: argparse.Namespace) -> list[Measurement]:
    """The measurements to make: all of them, or those ``--only`` names."""
    return [m for m in _measurements(args) if not args.only or m.key in args.only]


def _measurements(args: argparse.Namespace) -> list[Measurement]:
    n, single, pause = args.jobs, args.single, 0.02
    return [
        Measurement(
            "single",
            f"enqueue one by one, own transaction ({single:,})",
            lambda ctx: jobs_enqueue(ctx, single, bulk=False),
            lambda ctx: pgq_enqueue(ctx, single, bulk=False),
        ),
        Measurement(
            "single_prepared",
            f"enqueue one by one, prepared statements ({single:,})",
            lambda ctx: jobs_enqueue(ctx, single, bulk=False, prepared=True),
            lambda ctx: pgq_enqueue(ctx, single, bulk=False),
        ),
        Measurement(
            "bulk",
            f"bulk enqueue of {n:,} in one call",
            lambda ctx: jobs_enqueue(ctx, n, bulk=True),
            lambda ctx: pgq_enqueue(ctx, n, bulk=True),
        ),
        Measurement(
            "drain1",
            f"drain {n:,}, 1 process, defaults",
            lambda ctx: jobs_drain(ctx, n, 1, JOBS_DEFAULT),
            lambda ctx: pgq_drain(ctx, n, 1, PGQ_DEFAULT),
        ),
        Measurement(
            "drain2",
            f"drain {n:,}, 2 processes, best configuration",
            lambda ctx: jobs_drain(ctx, n, 2, JOBS_BEST),
            lambda ctx: pgq_drain(ctx, n, 2, BEST_PGQ),
        ),
        Measurement(
            "latency",
            f"idle pickup latency ({args.latency_jobs} jobs)",
            lambda ctx: jobs_latency(ctx, args.latency_jobs, pause),
            lambda ctx: pgq_latency(ctx, args.latency_jobs, pause),
        ),
    ]


def median(runs: list[dict], field: str) -> float:
    return statistics.median(run[field] for run in runs)


def progress(transport: str, key: str, system: str, result: dict) -> None:
    shown = ", ".join(f"{k} {v:,.1f}" for k, v in result.items())
    print(f"  {transport} {key} {system}: {shown}", file=sys.stderr)


def fmt(value: float, digits: int = 0) -> str:
    if value != value:
        return "n/a"
    return f"{value:,.{digits}f}"


def cpu_cell(runs: list[dict]) -> str:
    own, pg = median(runs, "own"), median(runs, "pg")
    return f"{fmt(own)} + {fmt(pg)} = {fmt(own + pg)}"


def spread(runs: list[dict], field: str) -> str:
    """(max - min) / median over the runs: how far apart the runs were."""
    values = [run[field] for run in runs]
    if len(values) < 2:
        return ""
    return f"{(max(values) - min(values)) / statistics.median(values):.0%}"


def system_table(results: dict, transport: str, plan: list[Measurement]) -> str:
    rows: list[list[object]] = []
    for m in plan:
        jobs_runs, pgq_runs = results[transport, m.key, "jobs"], results[transport, m.key, "pgq"]
        if m.key == "latency":
            for field in ("p50", "p99"):
                j, p = median(jobs_runs, field), median(pgq_runs, field)
                rows.append([f"{m.label} {field}", "ms", fmt(j, 1), fmt(p, 1), f"{j / p:.2f}"])
                rows[-1] += ["lower", "", ""]
                rows[-1].append(f"{spread(jobs_runs, field)} {spread(pgq_runs, field)}")
            continue
        j, p = median(jobs_runs, "rate"), median(pgq_runs, "rate")
        rows.append([m.label, "jobs/s", fmt(j), fmt(p), f"{j / p:.2f}", "higher"])
        rows[-1] += [cpu_cell(jobs_runs), cpu_cell(pgq_runs)]
        rows[-1].append(f"{spread(jobs_runs, 'rate')} {spread(pgq_runs, 'rate')}")
        if m.key == "drain2":
            for runs in (jobs_runs, pgq_runs):
                for run in runs:
                    run["total"] = run["own"] + run["pg"]
            j, p = median(jobs_runs, "total"), median(pgq_runs, "total")
            label = "CPU per job in that drain (worker + PG)"
            rows.append([label, "µs", fmt(j), fmt(p), f"{j / p:.2f}", "lower", "", ""])
            rows[-1].append(f"{spread(jobs_runs, 'total')} {spread(pgq_runs, 'total')}")
    headers = ["measurement", "unit", "jobs", "pgqueuer", "jobs/pgq", "better"]
    headers += ["jobs CPU µs/job", "pgqueuer CPU µs/job", "spread"]
    return table(headers, rows)


def transport_table(results: dict, plan: list[Measurement]) -> str:
    rows: list[list[object]] = []
    for m in plan:
        fields = ("p50", "p99") if m.key == "latency" else ("rate",)
        for field in fields:
            label = f"{m.label} {field}" if m.key == "latency" else m.label
            value = {
                (t, s): median(results[t, m.key, s], field)
                for t in ("unix", "tcp")
                for s in ("jobs", "pgq")
            }
            row: list[object] = [label]
            for s in ("jobs", "pgq"):
                unix, tcp = value["unix", s], value["tcp", s]
                row += [
                    fmt(unix, 1 if field != "rate" else 0),
                    fmt(tcp, 1 if field != "rate" else 0),
                ]
                row.append(f"{(tcp - unix) / unix:+.0%}")
            row += [
                f"{value['unix', 'jobs'] / value['unix', 'pgq']:.2f}",
                f"{value['tcp', 'jobs'] / value['tcp', 'pgq']:.2f}",
            ]
            rows.append(row)
    headers = ["measurement", "jobs unix", "jobs tcp", "tcp vs unix"]
    headers += ["pgq unix", "pgq tcp", "tcp vs unix", "jobs/pgq unix", "jobs/pgq tcp"]
    return table(headers, rows)


def latency_details(results: dict, transport: str) -> str:
    parts = []
    for system, name in (("jobs", "jobs"), ("pgq", "pgqueuer")):
        runs = results[transport, "latency", system]
        parts.append(
            f"{name}: commit→claim statement {median(runs, 'claim'):.1f} ms, "
            f"job seen finished {median(runs, 'done'):.1f} ms (p50)"
        )
    return "; ".join(parts)


def run_table(ctx: Context, args: argparse.Namespace, transports: list[str]) -> dict:
    plan = measurements(args)
    results: dict = defaultdict(list)
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs}", file=sys.stderr)
        order = transports if run % 2 == 0 else transports[::-1]  # drift hits both alike
        for m in plan:
            for transport in order:
                ctx.use(transport)
                for system, fn in (("jobs", m.jobs), ("pgq", m.pgq)):
                    result = fn(ctx)
                    results[transport, m.key, system].append(result)
                    progress(transport, m.key, system, result)
    return results


def print_table(results: dict, args: argparse.Namespace, transports: list[str], info: str) -> None:
    plan = measurements(args)
    print(info)
    print(
        "jobs: runworker at its defaults (20 handler threads) for 1 process, "
        f"{' '.join(JOBS_BEST)} for 2; pgqueuer: QueueManager defaults "
        f"({PGQ_DEFAULT.label()}) for 1, {BEST_PGQ.label()} for 2"
    )
    print(
        "CPU: client (enqueue) or worker processes (drain) + PostgreSQL, µs per job; jobs/pgq "
        "above 1 is better for jobs in throughput, below 1 in latency and CPU; spread: (max - "
        "min) / median over the runs, jobs then pgqueuer"
    )
    for transport in transports:
        print(f"\n{transport}, median of {args.runs} run{'s' * (args.runs > 1)}:")
        print(system_table(results, transport, plan))
        if results[transport, "latency", "jobs"]:
            print(latency_details(results, transport))
    if len(transports) == 2 and not args.only:
        print("\nwhat the transport explains (tcp against unix, medians; pgq = pgqueuer):")
        print(transport_table(results, plan))


# --- pgqueuer's configurations ----------------------------------------------------------------


def run_sweep(ctx: Context, args: argparse.Namespace, transport: str) -> None:
    """Drain with 2 processes of each configuration of one system, in turns, and print the
    medians: how ``BEST_PGQ`` and ``JOBS_BEST`` were chosen."""
    ctx.use(transport)
    if args.pgq_sweep:
        system = "pgqueuer"
        configs = {
            config.label(): partial(pgq_drain, ctx, args.jobs, 2, config) for config in SWEEP
        }
    else:
        system = "jobs (runworker)"
        configs = {
            " ".join(config): partial(jobs_drain, ctx, args.jobs, 2, config)
            for config in JOBS_SWEEP
        }
    results: dict = defaultdict(list)
    for run in range(args.runs):
        for label, drain in configs.items():
            result = drain()
            results[label].append(result)
            progress(transport, f"run {run + 1}", label, result)
    rows = [
        [label, median(runs, "rate"), median(runs, "own"), median(runs, "pg")]
        for label, runs in results.items()
    ]
    print(f"{system}, 2 processes draining {args.jobs:,} jobs, {transport}, median of {args.runs}")
    print(table(["configuration", "jobs/s", "worker CPU µs/job", "PG CPU µs/job"], rows))


# --- statements -------------------------------------------------------------------------------

OWN_STATEMENTS = re.compile(
    # this script's polls, counts, resets and set-up, and the workers' start-up checks
    r"pg_stat_statements|GROUP BY (status|state)\b|WHERE status = \$1$"
    r"|SELECT EXISTS \(SELECT \$1 FROM (pgqueuer|jobs_job)\b"
    r"|^(TRUNCATE|VACUUM|SHOW|SET|CREATE|LISTEN)\b"
    r"|pg_backend_pid|information_schema|pg_indexes|pg_enum"
)


def statements(ctx: Context, args: argparse.Namespace, transport: str) -> None:
    from django.db import connection

    ctx.use(transport)
    with connection.cursor() as cur:
        cur.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    assert ctx.poll is not None
    ctx.poll.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    single = min(args.single, 500)

    def reset() -> None:
        assert ctx.poll is not None
        ctx.poll.execute("SELECT pg_stat_statements_reset()")

    report = []
    for label, count, jobs_fn, pgq_fn in (
        (
            f"enqueue one by one ({single:,})",
            single,
            lambda: jobs_enqueue(ctx, single, bulk=False, ready=reset),
            lambda: pgq_enqueue(ctx, single, bulk=False, ready=reset),
        ),
        (
            f"drain {args.jobs:,}, 2 processes, best configuration",
            args.jobs,
            lambda: jobs_drain(ctx, args.jobs, 2, JOBS_BEST, ready=reset),
            lambda: pgq_drain(ctx, args.jobs, 2, BEST_PGQ, ready=reset),
        ),
    ):
        for name, database, fn in (
            ("jobs", ctx.jobs_db, jobs_fn),
            ("pgqueuer", ctx.pgq_db, pgq_fn),
        ):
            fn()
            rows = ctx.poll.execute(
                "SELECT calls, rows, total_exec_time, plans, total_plan_time, query "
                "FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) "
                "ORDER BY total_exec_time DESC",
                [database],
            ).fetchall()
            report.append((f"{name}: {label}", count, rows))
    full = []
    for title, count, rows in report:
        shown, total_calls, total_exec, total_plan = [], 0.0, 0.0, 0.0
        for calls, nrows, exec_ms, plans, plan_ms, query in rows:
            text = " ".join(query.split())
            if OWN_STATEMENTS.search(text) or not calls:
                continue
            total_calls += calls
            total_exec += exec_ms
            total_plan += plan_ms
            per_job = (plan_ms + exec_ms) * 1000 / count
            per_call = [
                nrows / calls,
                plans / calls,
                plan_ms * 1000 / calls,
                exec_ms * 1000 / calls,
            ]
            shown.append([calls / count, *per_call, per_job, text[:100]])
            full.append(
                f"-- {title}: {calls} calls, {nrows} rows, {plans} plans, "
                f"{plan_ms:.1f} ms planning, {exec_ms:.1f} ms executing\n{query}\n"
            )
        print(
            f"\n{title}: {total_calls / count:.2f} statements, {total_plan * 1000 / count:.1f} µs "
            f"planning and {total_exec * 1000 / count:.1f} µs executing per job"
        )
        headers = ["calls/job", "rows/call", "plans/call", "plan µs/call", "exec µs/call"]
        print(table([*headers, "µs/job", "statement"], shown))
    path = out_path("versus-statements.txt")
    path.write_text("\n".join(full))
    print(f"\nfull statement texts: {path.relative_to(ROOT)}")


# --- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp", "unix", "both"], default="tcp")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10_000, help="bulk enqueue and drains")
    parser.add_argument("--single", type=int, default=2_000, help="jobs enqueued one by one")
    parser.add_argument("--latency-jobs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="500 jobs, 1 run: a smoke run")
    parser.add_argument("--pgq-sweep", action="store_true", help="pgqueuer's configurations")
    parser.add_argument("--jobs-sweep", action="store_true", help="runworker's configurations")
    parser.add_argument("--statements", action="store_true", help="pg_stat_statements per job")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=MEASUREMENTS,
        help="make only these measurements (while working on one of them)",
    )
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.single, args.latency_jobs, args.runs = 500, 200, 50, 1
    transports = ["unix", "tcp"] if args.transport == "both" else [args.transport]

    ensure_venv()
    server: BenchServer | None = None
    agent: Agent | None = None
    ctx: Context | None = None
    # SIGTERM (a timeout, a CI stop) unwinds through the finally blocks: workers, agent, server.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        given = os.environ.get("DATABASE_URL")
        if given:
            kind = url_kind(given)
            if args.transport != kind:
                print(f"DATABASE_URL is a {kind} URL: measuring {kind} only", file=sys.stderr)
            transports, bases = [kind], {kind: given}
        else:
            server = (
                BenchServer(
                    preload="pg_stat_statements",
                    settings={"pg_stat_statements.track_planning": "on"},
                )
                if args.statements
                else BenchServer()
            )
            server.start()
            bases = {t: server.url(t) for t in ("tcp", "unix")}
        os.environ["DATABASE_URL"] = bases[transports[0]]
        jobs_url = setup_bench()
        jobs_db = urlsplit(jobs_url).path.lstrip("/")
        base_db = urlsplit(bases[transports[0]]).path.lstrip("/")
        pgq_db = base_db + PGQ_SUFFIX
        _create_database(bases[transports[0]], pgq_db)
        agent = Agent()
        ctx = Context(bases, jobs_db, pgq_db, agent)
        ctx.use(transports[0])
        agent.call("install")
        if ctx.cpu is None or not ctx.cpu.available:
            print("(PostgreSQL CPU not measured: the server is not on this machine)")
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("SHOW server_version")
            (version,) = cur.fetchone()
        where = "DATABASE_URL" if given else "the bench's own server"
        info = f"PostgreSQL {version} ({where}); {venv_versions()}"
        if args.statements:
            statements(ctx, args, transports[-1])
        elif args.pgq_sweep or args.jobs_sweep:
            run_sweep(ctx, args, transports[-1])
        else:
            results = run_table(ctx, args, transports)
            print_table(results, args, transports, info)
        truncate()
    finally:
        if ctx is not None:
            ctx.close()
        if agent is not None:
            agent.close()
        with suppress(Exception):
            from django.db import connection

            connection.close()
        if server is not None:
            server.stop()
    return report_problems()


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
