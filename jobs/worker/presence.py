"""The worker's row in ``jobs_process``: registered at start, beaten by the lease keeper.

The beat rides in the lease renewal the keeper makes every third of the lease, idle or busy
(:func:`jobs.queue.renew_leases`), so it costs no statement of its own; the row expires one
lease after the last beat, as the jobs' leases do. A clean stop (a drain, also one that ended
in the shutdown timeout) deletes the row; ``kill -9`` leaves it to show as gone.
"""

from __future__ import annotations

import logging

from jobs.queue.types import AllTenants, AllTenantsExcept, OnlyTenant, Scope
from jobs.runtime.process import Presence
from jobs.worker.config import WorkerConfig

logger = logging.getLogger("jobs.worker")


def worker_presence(config: WorkerConfig) -> Presence:
    return Presence(
        config.identity,
        component="worker",
        expires_in=config.lease_duration.total_seconds(),
        scope=describe(config.scope),
        concurrency=config.concurrency,
        logger=logger,
        using=config.database,
    )


def describe(scope: Scope) -> str:
    """How the processes page shows a scope: the ``runworker`` option that gives it."""
    if isinstance(scope, OnlyTenant):
        return f"tenant {scope.tenant}"
    if isinstance(scope, AllTenantsExcept):
        return f"component {scope.component}"
    if isinstance(scope, AllTenants):
        return "all tenants"
    return type(scope).__name__
