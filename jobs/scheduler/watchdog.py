"""The watchdog duty: recover running rows whose worker is gone, in every run table.

* The jobs table: a running job whose lease expired goes back to the queue if it has attempts
  left, else fails as ``lease_expired``; queued jobs over their type's (lowered) attempt limit
  fail as ``attempts_exhausted`` (``jobs.queue.requeue_expired`` / ``fail_exhausted``, every
  tenant).
* Every other concrete run-contract table whose ``reaped_when_stale`` is true: a running row
  whose heartbeat is older than its ``stale_after`` (default ``JOBS["STALE_AFTER"]``) fails as
  ``stale`` (``jobs.runs.reap_stale``), which frees its active-state lock for the next run.
  A row bound to a job type (``Policy(run_model=…)``) whose job is still active is skipped:
  the job's lease decides (see :mod:`jobs.queue.bound`).

Each statement handles at most ``batch_size`` rows and skips rows others have locked; a pass
repeats a statement at most ``max_batches`` times per table. A failing table is logged and
counted, and the pass goes on to the next one.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, router

from jobs import queue
from jobs.core.conf import jobs_settings
from jobs.db.clock import database_now
from jobs.queue import AllTenants
from jobs.queue import bound as binding
from jobs.runs import RunContract, reap_stale, run_contract_models
from jobs.scheduler import metrics

logger = logging.getLogger("jobs.scheduler")

JOBS_TABLE = "jobs.job"


@dataclass(frozen=True)
class WatchdogConfig:
    batch_size: int = 100  # rows per statement
    max_batches: int = 10  # statements per table per pass

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_batches < 1:
            raise ImproperlyConfigured(
                f"watchdog batch size and batches per pass must be at least 1, got "
                f"{self.batch_size} and {self.max_batches}"
            )


class Watchdog:
    """One pass over the jobs table and every stale-reaped run table."""

    def __init__(
        self,
        config: WatchdogConfig | None = None,
        *,
        max_attempts: Mapping[str, int] | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self.config = config or WatchdogConfig()
        self.max_attempts = dict(max_attempts or {})
        self.using = using

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Reap at ``now`` (default: database clock); counts by ``table:outcome``."""
        now = now or database_now(self.using)
        counts: Counter[str] = Counter()
        self._table(counts, JOBS_TABLE, "requeued", lambda n: self._requeue(now, n))
        self._table(counts, JOBS_TABLE, "failed", lambda n: self._exhaust(now, n))
        for model in run_contract_models():
            # On an alias the routers keep the table off, there is no table to scan.
            if model.reaped_when_stale and router.allow_migrate_model(self.using, model):
                label = model._meta.label_lower
                self._table(counts, label, "stale", partial(self._reap, model, now))
        return counts

    def _requeue(self, now: datetime, limit: int) -> list[int]:
        rows = queue.requeue_expired(scope=AllTenants(), limit=limit, now=now, using=self.using)
        return [row.id for row in rows]

    def _exhaust(self, now: datetime, limit: int) -> list[int]:
        rows = queue.fail_exhausted(
            scope=AllTenants(),
            max_attempts=self.max_attempts,
            limit=limit,
            now=now,
            using=self.using,
        )
        return [row.id for row in rows]

    def _reap(self, model: type[RunContract], now: datetime, limit: int) -> list[int]:
        stale_after = model.stale_after or jobs_settings.STALE_AFTER
        return reap_stale(
            model,
            stale_after=stale_after,
            now=now,
            limit=limit,
            unless_active=binding.bindings(model),
            using=self.using,
        )

    def _table(
        self,
        counts: Counter[str],
        table: str,
        outcome: str,
        batch: Callable[[int], list[int]],
    ) -> None:
        """Run one statement in batches until it comes back short; log the ids it moved."""
        ids: list[int] = []
        try:
            for _ in range(self.config.max_batches):
                found = batch(self.config.batch_size)
                ids.extend(found)
                if len(found) < self.config.batch_size:
                    break
        except Exception:
            counts["errors"] += 1
            metrics.errors.labels("watchdog").inc()
            logger.exception(
                "watchdog: %s pass over %s failed; will try again",
                outcome,
                table,
                extra={"action": "watchdog_failed", "table": table},
            )
        if not ids:
            return
        counts[f"{table}:{outcome}"] += len(ids)
        metrics.reaped.labels(table, outcome).inc(len(ids))
        logger.warning(
            "watchdog: %s %d rows of %s: ids %s",
            _VERBS[outcome],
            len(ids),
            table,
            ids,
            extra={"action": f"watchdog_{outcome}", "table": table, "ids": ids},
        )


_VERBS = {
    "requeued": "requeued (lease expired)",
    "failed": "failed (no attempts left)",
    "stale": "reaped as stale",
}
