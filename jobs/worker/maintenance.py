"""The worker's periodic pass: expired leases, exhausted jobs, backlog gauges.

Every worker runs it for its own tenant scope (the scheduler's watchdog runs the same queue
functions for all tenants), so jobs of a dead worker are recovered even when no scheduler
runs. Unsupported names are logged at start and whenever their count changes to non-zero.
"""

from __future__ import annotations

import logging
from collections import Counter

from django.db import connection

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

    def run_once(self) -> list[SweepRow]:
        """One pass; returns the jobs it failed (for the caller's terminal-failure hook)."""
        scope, limit = self.config.scope, self.config.maintenance_limit
        try:
            requeued = queue.requeue_expired(scope=scope, limit=limit)
            failed = queue.fail_exhausted(
                scope=scope, max_attempts=self.registry.max_attempts(), limit=limit
            )
            rows = queue.backlog(scope=scope, supported=self._names)
        except Exception:
            logger.exception("maintenance pass failed; will try again")
            connection.close()
            return []
        for row in requeued:
            metrics.expired_leases.labels(row.name).inc()
        if requeued:
            logger.warning(
                "requeued %d jobs whose lease expired: ids %s",
                len(requeued),
                [r.id for r in requeued],
                extra={"action": "requeue_expired"},
            )
        if failed:
            logger.warning(
                "failed %d jobs with no attempts left: ids %s",
                len(failed),
                [r.id for r in failed],
                extra={"action": "fail_exhausted"},
            )
        self._report_backlog(rows)
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
