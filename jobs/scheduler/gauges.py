"""The gauges duty: the backlog per type and the jobs table's health, once per deployment.

Only the leader runs it, every ``--gauge-interval`` (15 s) and at once when it becomes
leader, so one bounded count serves the whole deployment instead of one per worker replica:

* ``jobs_backlog{job_type, supported}``: queued jobs of each type, every tenant, from
  :func:`jobs.queue.backlog` (exact up to :data:`jobs.queue.BACKLOG_CAP`, the planner's
  estimate above). ``supported`` says whether this process registers the type; every
  registered type is exported, at 0 when nothing is queued. While unsupported jobs are
  queued, ``unsupported job types remain outstanding`` is logged whenever their count changes.
* ``jobs_backlog_oldest_due_seconds{job_type}``: how long the longest-waiting due job has
  been due, measured at the pass's database time.
* The console's backlog chart: one sample per type and minute in ``jobs_backlogsample``
  (:func:`jobs.queue.rollup.record_backlog`), the latest of the minute's passes.
* ``jobs_table_*{table}``: live and dead tuples, sizes, last autovacuum and autoanalyze of
  ``jobs_job``, from :func:`jobs.queue.table_health` (catalog reads only).

A standby exports none of these, and a leader that stands down withdraws them (the runner
calls :meth:`Gauges.withdraw`), so the figure a dashboard reads is the current leader's. One
part failing (a statement timeout on the count) is logged and counted; the other is still
exported.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS

from jobs import queue
from jobs.queue import BacklogRow, TableHealth
from jobs.scheduler import metrics
from jobs.scheduler.clock import database_now

logger = logging.getLogger("jobs.scheduler")

#: The tables whose health the duty exports.
TABLES = ("jobs_job",)


class Gauges:
    """Counts the backlog and reads the jobs table's health; exports both as gauges."""

    def __init__(self, names: Collection[str], *, using: str = DEFAULT_DB_ALIAS) -> None:
        self.names = frozenset(names)
        self.using = using
        self._unsupported_total = 0
        self._backlog_labels: set[tuple[str, str]] = set()
        self._index_labels: set[tuple[str, str]] = set()

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Refresh every gauge at ``now`` (default: database clock); counts types and errors."""
        now = now or database_now(self.using)
        counts: Counter[str] = Counter()
        self._part(counts, "the backlog count", lambda: self._backlog(now, counts))
        self._part(counts, "the table health read", lambda: self._health(counts))
        return counts

    def withdraw(self) -> None:
        """Stop exporting every gauge of this duty (this process no longer leads)."""
        for gauge in metrics.LEADER_GAUGES:
            gauge.clear()
        self._backlog_labels.clear()
        self._index_labels.clear()
        self._unsupported_total = 0

    def _part(self, counts: Counter[str], what: str, run: Callable[[], None]) -> None:
        """Run one part; a failure is logged and counted, and the other part still runs."""
        try:
            run()
        except Exception:
            counts["errors"] += 1
            metrics.errors.labels("gauges").inc()
            logger.exception(
                "gauges: %s failed; will try again", what, extra={"action": "gauges_failed"}
            )

    def _backlog(self, now: datetime, counts: Counter[str]) -> None:
        rows = queue.backlog(supported=self.names, using=self.using)
        self._export_backlog(rows, now)
        self._warn_unsupported(rows)
        self._record_backlog(rows, now)
        counts["types"] = len(rows)

    def _export_backlog(self, rows: list[BacklogRow], now: datetime) -> None:
        """Set each type's gauges, registered types at 0, and drop types no longer queued."""
        found = {row.name: row for row in rows}
        labels: set[tuple[str, str]] = set()
        for name in self.names | set(found):
            row = found.get(name)
            supported = "true" if name in self.names else "false"
            labels.add((name, supported))
            metrics.backlog.labels(name, supported).set(row.queued if row else 0)
            waited = (now - row.oldest_due).total_seconds() if row and row.oldest_due else 0.0
            metrics.oldest_due.labels(name).set(max(0.0, waited))
        for name, supported in self._backlog_labels - labels:
            metrics.backlog.remove(name, supported)
            metrics.oldest_due.remove(name)
        self._backlog_labels = labels

    def _record_backlog(self, rows: list[BacklogRow], now: datetime) -> None:
        """Keep this minute's sample for the console's backlog chart (registered types at 0)."""
        found = {row.name: row for row in rows}
        samples: list[tuple[str, int, int, float | None]] = []
        for name in sorted(self.names | set(found)):
            row = found.get(name)
            if row is None:
                samples.append((name, 0, 0, None))
                continue
            waited = (now - row.oldest_due).total_seconds() if row.oldest_due else None
            samples.append(
                (name, row.queued, row.due, None if waited is None else max(0.0, waited))
            )
        queue.rollup.record_backlog(samples, at=now, using=self.using)

    def _warn_unsupported(self, rows: list[BacklogRow]) -> None:
        """Log unsupported names whenever their total changes to a count other than zero."""
        unsupported = {row.name: row.queued for row in rows if not row.supported}
        total = sum(unsupported.values())
        if total and total != self._unsupported_total:
            logger.warning(
                "unsupported job types remain outstanding: %s",
                ", ".join(f"{name} ({n})" for name, n in sorted(unsupported.items())),
                extra={"action": "unsupported_backlog", "count": total},
            )
        self._unsupported_total = total

    def _health(self, counts: Counter[str]) -> None:
        indexes: set[tuple[str, str]] = set()
        for table in TABLES:
            health = queue.table_health(table, using=self.using)
            self._export_health(health)
            indexes |= {(health.table, index) for index in health.index_bytes}
            counts["tables"] += 1
        for table, index in self._index_labels - indexes:  # dropped by a migration
            metrics.index_size.remove(table, index)
        self._index_labels = indexes

    def _export_health(self, health: TableHealth) -> None:
        table = health.table
        metrics.live_tuples.labels(table).set(health.live_tuples)
        metrics.dead_tuples.labels(table).set(health.dead_tuples)
        metrics.table_size.labels(table).set(health.table_bytes)
        for index, size in health.index_bytes.items():
            metrics.index_size.labels(table, index).set(size)
        metrics.last_autovacuum.labels(table).set(_timestamp(health.last_autovacuum))
        metrics.last_autoanalyze.labels(table).set(_timestamp(health.last_autoanalyze))


def _timestamp(moment: datetime | None) -> float:
    return moment.timestamp() if moment else 0.0
