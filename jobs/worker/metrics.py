"""Prometheus metrics of the worker. Labels are bounded: job type, outcome and error code only
(never a job id or tenant), so cardinality grows with the number of registered types.

Gauges of the whole queue (the backlog, the jobs table's health) are not here: the scheduler's
leader exports them once per deployment (:mod:`jobs.scheduler.metrics`)."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

claimed = Counter("jobs_claimed_total", "Jobs claimed by this worker.", ["job_type"])
outcomes = Counter(
    "jobs_outcomes_total",
    "Attempt outcomes written: succeeded, retried (back to the queue), failed (terminal) "
    "or cancelled (as an operator asked).",
    ["job_type", "outcome"],
)
terminal_failures = Counter(
    "jobs_terminal_failures_total",
    "Jobs that became failed, by error code (from a handler or an exhaustion pass).",
    ["job_type", "code"],
)
expired_leases = Counter(
    "jobs_expired_leases_total",
    "Jobs whose lease expired without an outcome, found by a maintenance pass.",
    ["job_type"],
)
fenced_outcomes = Counter(
    "jobs_fenced_outcomes_total",
    "Outcomes discarded because this worker no longer held the job's claim token.",
    ["job_type"],
)
lost_leases = Counter(
    "jobs_lost_leases_total",
    "Running jobs whose lease renewal found the job taken away; their handlers were cancelled.",
    ["job_type"],
)
released = Counter(
    "jobs_released_total", "Jobs handed back to the queue untried at shutdown.", ["job_type"]
)
throttles = Counter(
    "jobs_throttles_total",
    "Times a handler's RetryAfter(throttle=True) paused its job type for every worker.",
    ["job_type"],
)


class TypeHistogram(Collector):
    """A histogram labelled by job type, observed once a job, exported when scraped.

    It exposes what a ``prometheus_client.Histogram`` with a ``job_type`` label would (the
    ``_bucket``, ``_count``, ``_sum`` and ``_created`` samples), but an observation is a
    bisect and two additions under one lock: the library's takes two locks and five Python
    calls, and a busy worker observes two histograms a job.
    """

    type = "histogram"
    labelnames = ("job_type",)

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(bound) for bound in buckets)
        self._lock = threading.Lock()
        # job type -> [count in each bucket (the last is +Inf), sum of the values]
        self._counts: dict[str, list[float]] = {}
        self._created: dict[str, float] = {}  # job type -> when its series began (Unix time)

    def labels(self, job_type: str) -> TypeHistogramChild:
        with self._lock:
            counts = self._counts.get(job_type)
            if counts is None:
                counts = self._counts[job_type] = [0.0] * (len(self.bounds) + 2)
                self._created[job_type] = time.time()
        return TypeHistogramChild(self._lock, self.bounds, counts)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        """The family without samples (the registry checks names with it)."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            taken = {name: list(counts) for name, counts in self._counts.items()}
        # The library's own formatting of a bucket's bound (its stubs leave it untyped).
        edges = [floatToGoString(b) for b in (*self.bounds, math.inf)]  # type: ignore[no-untyped-call]
        # The library's switch for _created series (disable_created_metrics(), or the
        # PROMETHEUS_DISABLE_CREATED_SERIES environment variable); it has no public getter.
        created = getattr(prometheus_metrics, "_use_created", True)
        for name, counts in sorted(taken.items()):
            buckets = list(zip(edges, itertools.accumulate(counts[:-1]), strict=True))
            family.add_metric([name], buckets, sum_value=counts[-1])
            if created:
                family.samples.append(
                    Sample(f"{self.name}_created", {"job_type": name}, self._created[name])
                )
        yield family


class TypeHistogramChild:
    """One job type's counts in a :class:`TypeHistogram`."""

    __slots__ = ("_bounds", "_counts", "_lock")

    def __init__(self, lock: threading.Lock, bounds: tuple[float, ...], counts: list[float]):
        self._lock = lock
        self._bounds = bounds
        self._counts = counts

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is at least it (NaN in none)."""
        counts = self._counts
        with self._lock:
            counts[-1] += value
            if value == value:  # as prometheus_client: NaN goes to the sum alone
                counts[bisect.bisect_left(self._bounds, value)] += 1


handler_duration = TypeHistogram(
    "jobs_handler_duration_seconds",
    "Wall time of handler calls.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
)
queue_latency = TypeHistogram(
    "jobs_queue_latency_seconds",
    "Time from when a job was due to when a worker claimed it.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
)
REGISTRY.register(handler_duration)
REGISTRY.register(queue_latency)
loop_errors = Counter(
    "jobs_worker_loop_errors_total",
    "Run-loop passes that failed on a database error (each followed by a backoff).",
)
running = Gauge("jobs_worker_running", "Handlers running in this worker process.")
# The workers of this process whose handlers the gauge counts: it reads their count when
# scraped, so starting and ending a handler costs an integer under the worker's own lock, not
# two updates of the gauge's.
_counted: weakref.WeakSet[RunningCount] = weakref.WeakSet()
_counted_lock = threading.Lock()
ready = Gauge("jobs_worker_ready", "1 while this worker claims work, 0 while starting or draining.")
listening = Gauge(
    "jobs_worker_listening",
    "1 while a proven LISTEN wakes this worker; 0 while it finds new work by polling only.",
)


@dataclass(frozen=True)
class TypeMetrics:
    """The per-job-type children of the metrics above, looked up once per type, not per job."""

    claimed: Counter
    queue_latency: TypeHistogramChild
    handler_duration: TypeHistogramChild
    succeeded: Counter
    retried: Counter
    failed: Counter
    cancelled: Counter

    def outcome(self, kind: str) -> Counter:
        counter: Counter = getattr(self, kind)
        return counter


@cache
def for_type(name: str) -> TypeMetrics:
    return TypeMetrics(
        claimed=claimed.labels(name),
        queue_latency=queue_latency.labels(name),
        handler_duration=handler_duration.labels(name),
        succeeded=outcomes.labels(name, "succeeded"),
        retried=outcomes.labels(name, "retried"),
        failed=outcomes.labels(name, "failed"),
        cancelled=outcomes.labels(name, "cancelled"),
    )


class RunningCount(Protocol):
    @property
    def handlers_running(self) -> int: ...


def count_running(worker: RunningCount) -> None:
    """Count ``worker.handlers_running`` in ``jobs_worker_running`` while it lives."""
    with _counted_lock:
        _counted.add(worker)


def _running_now() -> float:
    with _counted_lock:
        return float(sum(worker.handlers_running for worker in _counted))


running.set_function(_running_now)
