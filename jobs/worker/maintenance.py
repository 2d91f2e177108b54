"""The worker's periodic passes: expired leases (every second) and exhausted jobs.

Every worker runs them for its own tenant scope (the scheduler's watchdog runs the same queue
functions for all tenants), so jobs of a dead worker are recovered even when no scheduler
runs. Both cost what they find, not the size of the backlog. Counting the backlog (and
logging unsupported names) is the scheduler leader's job, once per deployment
(:mod:`jobs.scheduler.gauges`): a count per worker would multiply one answer by the number of
replicas.
"""

from __future__ import annotations

import logging

from jobs import queue
from jobs.catalogue.registry import Registry
from jobs.queue import SweepRow
from jobs.worker import metrics
from jobs.worker.config import WorkerConfig

logger = logging.getLogger("jobs.worker")


class WorkerMaintenance:
    def __init__(self, config: WorkerConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry

    def recover(self) -> list[SweepRow]:
        """Requeue running jobs whose lease expired (a worker died); raises DatabaseError.

        Cheap enough to run every second: it reads only running rows, through their index.
        """
        requeued = queue.requeue_expired(
            scope=self.config.scope,
            limit=self.config.maintenance_limit,
            using=self.config.database,
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
        """Fail exhausted jobs (one bounded statement); raises DatabaseError.

        Returns the jobs it failed (for the caller's terminal-failure hook).
        """
        scope, limit = self.config.scope, self.config.maintenance_limit
        failed = queue.fail_exhausted(
            scope=scope,
            max_attempts=self.registry.max_attempts(),
            limit=limit,
            using=self.config.database,
        )
        if failed:
            logger.warning(
                "failed %d jobs with no attempts left: ids %s",
                len(failed),
                [r.id for r in failed],
                extra={"action": "fail_exhausted"},
            )
        return failed
