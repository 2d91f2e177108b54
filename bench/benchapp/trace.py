"""Measurement-only instrumentation of the worker's control loop (``BENCH_TRACE=FILE``).

When a worker process started with ``DJANGO_SETTINGS_MODULE=bench.settings`` has
``BENCH_TRACE`` set, :func:`install` wraps a few functions of the run loop (without changing
what they do) to time them on the control thread, and writes the totals as JSON to that file
when the process exits. ``bench/profile_worker.py`` prints them. Nothing here is used by the
``jobs`` app itself.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections import defaultdict
from functools import wraps

_totals: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_sizes: dict[str, int] = defaultdict(int)
_lock = threading.Lock()
_job_times: dict[str, list[float]] = defaultdict(list)  # per-job lifecycle delays


def _add(name: str, seconds: float, size: int = 0) -> None:
    with _lock:
        _totals[name] += seconds
        _calls[name] += 1
        _sizes[name] += size


_phase = threading.local()  # which timed step the control thread is in


def _timed(owner, attr: str, name: str, size=None) -> None:
    original = getattr(owner, attr)

    @wraps(original)
    def wrapper(*args, **kwargs):
        outer = getattr(_phase, "name", None)
        _phase.name = name
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _phase.name = outer
            count = size(args, kwargs) if size else 0
            _add(name, time.perf_counter() - started, count)

    setattr(owner, attr, wrapper)


def install(path: str) -> None:
    """Instrument the run loop; ``{pid}`` in ``path`` becomes the process id (several workers)."""
    import os

    import psycopg
    from django.db.backends.base.base import BaseDatabaseWrapper

    from jobs import queue
    from jobs.worker import runner

    path = path.replace("{pid}", str(os.getpid()))

    worker = runner.Worker
    _timed(worker, "_pass", "pass (whole)")
    _timed(worker, "_maintain", "maintenance")
    _timed(queue, "record", "record outcomes (SQL)", size=lambda a, k: len(a[0]))
    _timed(queue, "claim", "claim (SQL)")
    _timed(queue, "record_and_claim", "outcomes + claim (SQL)", size=lambda a, k: len(a[0]))
    _timed(worker, "_dispatch", "dispatch to pool", size=lambda a, k: len(a[1]))
    _timed(worker, "_settle", "settle acks", size=lambda a, k: len(a[1]))
    _timed(worker, "_take_acks", "take acks")
    _timed(worker, "_claim_requests", "claim requests")

    commit = BaseDatabaseWrapper.commit

    @wraps(commit)
    def timed_commit(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return commit(self, *args, **kwargs)
        _phase.name = "commit"
        started = time.perf_counter()
        try:
            return commit(self, *args, **kwargs)
        finally:
            _phase.name = None
            _add("commit", time.perf_counter() - started)

    BaseDatabaseWrapper.commit = timed_commit

    # Time the control thread spends in psycopg's wait for the server (network round trips,
    # server time, and getting the GIL back), by step; the rest of a step is Python.
    wait = psycopg.Connection.wait

    @wraps(wait)
    def timed_wait(self, *args, **kwargs):
        name = getattr(_phase, "name", None)
        if name is None or threading.current_thread() is not threading.main_thread():
            return wait(self, *args, **kwargs)
        started = time.perf_counter()
        try:
            return wait(self, *args, **kwargs)
        finally:
            _add(f"{name}: waiting for PostgreSQL", time.perf_counter() - started)

    psycopg.Connection.wait = timed_wait

    # The idle wait of the loop: Worker.run calls self._wake.wait(self._wait_time()).
    wait_time = worker._wait_time

    @wraps(wait_time)
    def timed_wait_time(self):
        value = wait_time(self)
        _add("loop wait (requested s)", value)
        return value

    worker._wait_time = timed_wait_time

    # Per job: claim → handler start (pool queueing) and handler end → outcome flushed.
    execute = runner.execute

    @wraps(execute)
    def timed_execute(running, **kwargs):
        start = time.monotonic()
        with _lock:
            _job_times["claimed → handler start"].append(start - running.claimed_at)
        try:
            return execute(running, **kwargs)
        finally:
            running.bench_finished = time.monotonic()

    runner.execute = timed_execute
    settle = worker._settle

    @wraps(settle)
    def timed_settle(self, acks, outcomes, report):
        now = time.monotonic()
        with _lock:
            for running, _ in acks:
                finished = getattr(running, "bench_finished", None)
                if finished is not None:
                    _job_times["handler end → outcome flushed"].append(now - finished)
        return settle(self, acks, outcomes, report)

    worker._settle = timed_settle

    run = worker.run

    @wraps(run)
    def timed_run(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            _add("run (whole)", time.perf_counter() - started)

    worker.run = timed_run
    atexit.register(_dump, path)


def _dump(path: str) -> None:
    def pct(values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0

    with _lock:
        data = {
            "totals": dict(_totals),
            "calls": dict(_calls),
            "sizes": dict(_sizes),
            "jobs": {
                name: {"n": len(v), "p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99)}
                for name, v in _job_times.items()
            },
        }
    with open(path, "w") as out:
        json.dump(data, out, indent=1)
