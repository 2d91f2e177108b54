"""The worker's periodic passes: expired leases (every second), exhausted jobs, backlog gauges.

Every worker runs it for its own tenant scope (the scheduler's watchdog runs the same queue
functions for all tenants), so jobs of a dead worker are recovered even when no scheduler
runs. Unsupported names are logged at start and whenever their count changes to non-zero.
"""

from __future__ import annotations

import logging
from collections import Counter

from jobs import queue
from jobs.queue import BacklogRow, SweepRow
from jobs.registry import Registry
from jobs.worker import metrics
from jobs.worker.config import WorkerConfig

logger = logging.getLogger("jobs.worker")


class WorkerMaintenance:
    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self._names = list(registry.names())
        self._unsupported_total = 0

    def recover(self) -> list[SweepRow]:
        """Requeue running jobs whose lease expired (a worker died); raises DatabaseError.

        Cheap enough to run every second: it reads only running rows, through their index.
        """
        requeued = queue.requeue_expired(
            scope=self.config.scope, limit=self.config.maintenance_limit
        )
        for row in requeued:
            metrics.expired_leases.labels(row.name).inc()
        if requeued:
            logger.warning(
                "requeued %d jobs whose lease expired: ids %s",
                len(requeued),
                [r.id for r in requeued],
                extra={"action": "requeue_expired"},
            )
        return requeued

    def run_once(self) -> list[SweepRow]:
        """Fail exhausted jobs and refresh the backlog gauges; raises DatabaseError.

        Returns the jobs it failed (for the caller's terminal-failure hook).
        """
        scope, limit = self.config.scope, self.config.maintenance_limit
        failed = queue.fail_exhausted(
            scope=scope, max_attempts=self.registry.max_attempts(), limit=limit
        )
        if failed:
            logger.warning(
                "failed %d jobs with no attempts left: ids %s",
                len(failed),
                [r.id for r in failed],
                extra={"action": "fail_exhausted"},
            )
        self._report_backlog(queue.backlog(scope=scope, supported=self._names))
        return failed

    def _report_backlog(self, rows: list[BacklogRow]) -> None:
        totals: Counter[tuple[str, str]] = Counter()
        for row in rows:
            totals[(row.name, "true" if row.supported else "false")] += row.queued
        metrics.backlog.clear()
        for (name, supported), count in totals.items():
            metrics.backlog.labels(name, supported).set(count)
        unsupported = {name: n for (name, ok), n in totals.items() if ok == "false"}
        total = sum(unsupported.values())
        if total and total != self._unsupported_total:
            logger.warning(
                "unsupported job types remain outstanding: %s",
                ", ".join(f"{name} ({n})" for name, n in sorted(unsupported.items())),
                extra={"action": "unsupported_backlog", "count": total},
            )
        self._unsupported_total = total
