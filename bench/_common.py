"""Helpers the benchmark scripts share: Django setup, CPU accounting, worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _setup import ROOT, setup

PYTHON = sys.executable
MANAGE = str(ROOT / "manage.py")
OUT_DIR = ROOT / "var" / "bench"  # profiles and other artefacts (git-ignored)

#: Workers that exited badly when stopped; scripts print these after their figures and exit 1.
problems: list[str] = []


def setup_bench() -> str:
    """Configure Django on the bench database with ``bench.settings``; returns its URL."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    return setup()


def truncate() -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job")
        cur.execute("SELECT to_regclass('jobs_jobhistory') IS NOT NULL")
        if cur.fetchone()[0]:  # finished jobs the archive moved, where the app has it
            cur.execute("TRUNCATE jobs_jobhistory")
    ready_history()


def ready_history() -> None:
    """Make the history ready ahead, as a deployment's scheduler keeps it, so jobs that end
    leave the jobs table in the statement that ends them (where the app does that)."""
    from jobs.queue import history

    prepare_ahead = getattr(history, "prepare_ahead", None)
    if prepare_ahead is not None:
        prepare_ahead()


def vacuum() -> None:
    """VACUUM ANALYZE the jobs table so every run starts from the same table state."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")


def kinds() -> dict[str, type]:
    """The benchmark payload classes by short name (``--type`` of the drain scripts)."""
    from bench.benchapp import jobs as bench_jobs

    return {
        "noop": bench_jobs.Noop,
        "touch": bench_jobs.Touch,
        "append": bench_jobs.Append,
        "sleep": bench_jobs.Sleep,
        "asleep": bench_jobs.AsyncSleep,
    }


def enqueue_noops(count: int, *, batch: int = 1000, kind: str = "noop", **options) -> None:
    """Enqueue ``count`` benchmark jobs in batches (``kind``: a key of ``KINDS``)."""
    import jobs

    payload = kinds()[kind]
    for first in range(0, count, batch):
        last = min(first + batch, count)
        jobs.enqueue_many([payload(n=i) for i in range(first, last)], **options)


def db_counters() -> tuple[int, int]:
    """(next transaction id, WAL position in bytes): deltas give write transactions and WAL.

    Reading them assigns no transaction id, so polling does not disturb the count.
    """
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint"
        )
        xid, wal = cur.fetchone()
    return int(xid), int(wal)


def counts() -> dict[str, int]:
    """Jobs by state, in either home: a job that ended may have left for the history."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT state, count(*) FROM ("
            " SELECT state FROM jobs_job UNION ALL SELECT state FROM jobs_jobhistory"
            ") AS j GROUP BY state"
        )
        return dict(cur.fetchall())


#: Every job, in either home, with the columns the benchmarks read once jobs have run: a job
#: that ended may have left for the history in the statement that ended it.
EVERY_JOB = (
    "(SELECT id, name, state, tenant, run_after, started_at, finished_at, claimed_by"
    " FROM jobs_job UNION ALL"
    " SELECT id, name, state, tenant, run_after, started_at, finished_at, claimed_by"
    " FROM jobs_jobhistory) AS every_job"
)

#: Seconds from the first job's start to the last one's end.
SPAN = f"SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM {EVERY_JOB}"

#: One job's state, result and start (seconds since the epoch) by id, in either home: a job
#: that ended may have left for the history in the statement that ended it.
JOB_BY_ID = """
SELECT state, result, extract(epoch FROM started_at) FROM jobs_job WHERE id = %(id)s
UNION ALL
SELECT state, result, extract(epoch FROM started_at) FROM jobs_jobhistory WHERE id = %(id)s
LIMIT 1
"""

#: Cheap (about 0.1 ms): stops at the first unfinished job. count(*) costs 1-2 ms per poll
#: on a 20,000-row table, which would show up in the server's CPU figures.
UNFINISHED = "SELECT EXISTS (SELECT 1 FROM jobs_job WHERE state IN ('queued', 'running'))"


def wait_until_done(
    expected: int,
    *,
    timeout: float,
    interval: float = 0.01,
    probe: Callable[[Any], None] | None = None,
) -> float:
    """Poll until no job is queued or running; returns the monotonic time it was seen.

    ``probe(cursor)``, when given, runs after every poll that found work left, on the same
    connection, so what it reads (``pg_stat_activity``, say) costs no backend of its own.
    """
    from django.db import connection

    deadline = time.monotonic() + timeout
    with connection.cursor() as cur:
        while True:
            cur.execute(UNFINISHED)
            (unfinished,) = cur.fetchone()
            now = time.monotonic()
            if not unfinished:
                break
            if now > deadline:
                raise SystemExit(f"timed out with jobs not finished: {counts()}")
            if probe is not None:
                probe(cur)
            time.sleep(interval)
    done = counts()
    if done.get("succeeded", 0) != expected:
        raise SystemExit(f"expected {expected} succeeded jobs, found {done}")
    return now


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


class PostgresCpu:
    """CPU used by PostgreSQL for the bench database, read from /proc (psutil).

    Counts the live server processes that serve the bench database (backends, autovacuum
    workers), the server-wide background processes (WAL writer, checkpointer, background
    writer, I/O workers), the postmaster itself (it forks every new connection) and the
    backends that exited meanwhile (the postmaster's reaped children, from any database: a
    worker that opens a connection per job is only measurable this way). Live backends of
    other databases (a test run on the same server) are left out, but their exits are not:
    measure on an otherwise idle server. Only available when the server runs on this machine
    (the embedded one does).
    """

    _BACKGROUND = ("walwriter", "checkpointer", "background writer", "io worker", "walsummarizer")

    def __init__(self) -> None:
        from django.db import connection

        with connection.cursor() as cur:
            cur.execute("SELECT pg_backend_pid(), current_database()")
            backend, self.database = cur.fetchone()
        try:
            self.own_backend: psutil.Process | None = psutil.Process(backend)
            self.postmaster: psutil.Process | None = self.own_backend.parent()
        except psutil.Error:
            self.own_backend = self.postmaster = None

    @property
    def available(self) -> bool:
        return self.postmaster is not None

    def _ours(self, proc: psutil.Process) -> bool:
        title = " ".join(proc.cmdline()).removeprefix("postgres: ")
        return f" {self.database} " in f" {title} " or title.startswith(self._BACKGROUND)

    def backends(self) -> dict[int, float]:
        """CPU seconds so far of each counted server process, by pid."""
        result: dict[int, float] = {}
        if self.postmaster is None:
            return result
        for child in self.postmaster.children():
            with suppress(psutil.NoSuchProcess):
                if self._ours(child):
                    result[child.pid] = cpu_seconds(child)
        return result

    def total(self, *, exclude_self: bool = False) -> float:
        """CPU seconds so far of the counted processes; ``exclude_self`` leaves out the
        backend serving this script (its polling is not the workers' cost)."""
        if self.postmaster is None or self.own_backend is None:
            return float("nan")
        by_pid = self.backends()
        if exclude_self:
            by_pid.pop(self.own_backend.pid, None)
        t = self.postmaster.cpu_times()
        return sum(by_pid.values()) + t.user + t.system + t.children_user + t.children_system


@dataclass
class WorkerProcess:
    """One ``manage.py runworker`` process, with its stderr collected on a thread.

    ``wrapped`` means the process was started under a launcher (``py-spy record -- …``): the
    worker is then the launcher's child, which is what gets measured and signalled.
    """

    args: Sequence[str]
    popen: subprocess.Popen
    wrapped: bool = False
    lines: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0  # monotonic time its "worker … started" line arrived
    cpu_at_start: float = 0.0  # its CPU seconds at that moment (Django start-up)
    _proc: psutil.Process | None = None

    @property
    def proc(self) -> psutil.Process:
        """The worker's own process (the launcher's child when wrapped)."""
        if self._proc is None:
            launcher = psutil.Process(self.popen.pid)
            if not self.wrapped:
                self._proc = launcher
            else:
                deadline = time.monotonic() + 10
                while not (children := launcher.children()):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.args[0]} started no worker process")
                    time.sleep(0.01)
                self._proc = children[0]
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))
            if not self.started.is_set() and " started: " in line:
                self.started_at = time.monotonic()
                with suppress(psutil.Error, RuntimeError):
                    self.cpu_at_start = cpu_seconds(self.proc)
                self.started.set()

    def cpu(self) -> float:
        return cpu_seconds(self.proc)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM the worker (graceful drain), then SIGKILL if it is not gone in ``timeout``.

        Returns the worker's exit code (the launcher's, when wrapped: py-spy passes it on).
        """
        if self.popen.poll() is None:
            with suppress(psutil.Error, RuntimeError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with suppress(psutil.Error, RuntimeError):
                    self.proc.kill()
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def tail(self, count: int = 20) -> str:
        return "\n".join(self.lines[-count:])


def start_worker(
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    python_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """Start ``manage.py runworker ARGS``, optionally under a launcher ``PREFIX`` (py-spy) or
    with interpreter options ``PYTHON_ARGS`` (``-m cProfile -o FILE``) and extra ``ENV``."""
    env = {
        **os.environ,
        **(env or {}),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "PYTHONUNBUFFERED": "1",
    }
    command = [*prefix, PYTHON, *python_args, MANAGE, "runworker", *args]
    popen = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = WorkerProcess(command, popen, wrapped=bool(prefix))
    threading.Thread(target=worker._read, daemon=True).start()
    return worker


@contextmanager
def running_workers(
    count: int,
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    python_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout: float = 60.0,
) -> Iterator[list[WorkerProcess]]:
    """Start ``count`` workers and wait until each logged that it started; always stop them."""
    workers: list[WorkerProcess] = []
    try:
        for _ in range(count):
            workers.append(start_worker(args, prefix=prefix, python_args=python_args, env=env))
        wait_started(workers, ready_timeout)
        yield workers
    finally:
        for worker in workers:
            code = worker.stop()
            if code != 0:
                problems.append(
                    f"worker {worker.popen.pid} (runworker {' '.join(args)}) exited {code} "
                    f"when stopped:\n{worker.tail()}"
                )


def report_problems() -> int:
    """Print what went wrong with workers (after the figures); 1 if anything did."""
    sys.stdout.flush()
    for problem in problems:
        print(f"\nERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


def wait_started(workers: Sequence[WorkerProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for worker in workers:
        while not worker.started.wait(0.05):
            if worker.popen.poll() is not None:
                time.sleep(0.2)  # let the reader collect the traceback
                raise SystemExit(f"worker {worker.popen.pid} exited at start:\n{worker.tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"worker {worker.popen.pid} did not start:\n{worker.tail()}")


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of ``values`` (which need not be sorted)."""
    ordered = sorted(values)
    rank = max(1, round(pct / 100 * len(ordered) + 0.4999))
    return ordered[min(rank, len(ordered)) - 1]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table, right-aligned columns."""
    cells = [list(map(str, headers))] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def out_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / name
