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
* ``jobs_flow_*{job_type}``: for each type with flow control (a limit the fleet shares, or
  fairness) and each type a throttle holds now: its running jobs and global limit, its rate
  bucket's tokens, the seconds left of a throttle, and its due jobs a limit holds back now
  (:func:`held_back`), from :func:`jobs.queue.flow_state.state`, the pauses and, for types read
  tenant by tenant, :func:`jobs.queue.flow_state.tenant_backlog`. Never per tenant.

A standby exports none of these, and a leader that stands down withdraws them (the runner
calls :meth:`Gauges.withdraw`), so the figure a dashboard reads is the current leader's. One
part failing (a statement timeout on the count) is logged and counted; the others are still
exported.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS
from prometheus_client import Gauge

from jobs import queue
from jobs.catalogue.registry import get_registry
from jobs.db.clock import database_now
from jobs.models import PauseKind
from jobs.queue import BacklogRow, TableHealth, flow, flow_state
from jobs.queue.flow import FlowLimits
from jobs.queue.flow_state import FlowState, TenantFlow
from jobs.queue.pauses import PauseRow
from jobs.scheduler import metrics

logger = logging.getLogger("jobs.scheduler")

#: The tables whose health the duty exports.
TABLES = ("jobs_job",)
#: Tenants read per tenant-ordered type, the most due first: the console's list and the bound
#: of the tenant part of ``jobs_flow_limited``.
TENANT_ROWS = 20

#: What may hold a type's due jobs back now, in the order :func:`held_back` reports them.
PAUSED, THROTTLE, GLOBAL, RATE, TENANT = "paused", "throttle", "global", "rate", "tenant"


@dataclass(frozen=True)
class Held:
    """What holds a type's due jobs back now: the limits with no room, and how many jobs.

    ``tenants`` are the listed tenants with due jobs whose own limit has no room.
    """

    reasons: tuple[str, ...] = ()
    jobs: int = 0
    tenants: tuple[str, ...] = ()


def held_back(
    limits: FlowLimits | None,
    state: FlowState | None,
    pause: PauseRow | None = None,
    tenants: Sequence[TenantFlow] = (),
    tenant_tokens: Mapping[str, float] | None = None,
    *,
    now: datetime,
) -> Held:
    """Which limits hold due jobs of one type back now, and how many of them.

    A pause or a throttle in force, the type at its global limit, or its bucket without a
    whole token holds back every due job; otherwise the listed tenants with due jobs at their
    tenant limit or without a token in their bucket hold back theirs (a floor when the type
    has more tenants than are listed). Nothing is held back while nothing is due.
    """
    if state is None or state.due <= 0:
        return Held()
    reasons: list[str] = []
    if pause is not None and (pause.until is None or pause.until > now):
        reasons.append(PAUSED if pause.until is None else THROTTLE)
    if limits is not None:
        if limits.global_concurrency is not None and state.running >= limits.global_concurrency:
            reasons.append(GLOBAL)
        if limits.rate is not None and state.tokens is not None and state.tokens < 1:
            reasons.append(RATE)
    full = tuple(t.tenant for t in tenants if tenant_full(limits, t, tenant_tokens))
    if reasons:  # every due job waits, whatever its tenant
        return Held((*reasons, *([TENANT] if full else [])), state.due, full)
    if full:
        waiting = sum(t.due for t in tenants if t.tenant in full)
        return Held((TENANT,), min(state.due, waiting), full)
    return Held()


def tenant_full(
    limits: FlowLimits | None, tenant: TenantFlow, tokens: Mapping[str, float] | None = None
) -> bool:
    """The tenant has due jobs and its own limit (concurrency or bucket) has no room."""
    if limits is None or tenant.due <= 0:
        return False
    cap = limits.tenant_concurrency
    if cap is not None and tenant.running >= cap:
        return True
    left = (tokens or {}).get(tenant.tenant)
    return limits.tenant_rate is not None and left is not None and left < 1


class Gauges:
    """Counts the backlog and reads the jobs table's health; exports both as gauges."""

    def __init__(
        self,
        names: Collection[str],
        *,
        limits: Mapping[str, FlowLimits] | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        """``limits``: the flow controls of the types that have them (default: the registry's
        for ``names``)."""
        self.names = frozenset(names)
        self.limits = dict(_registered_limits(self.names) if limits is None else limits)
        self.using = using
        self._unsupported_total = 0
        self._backlog_labels: set[tuple[str, str]] = set()
        self._index_labels: set[tuple[str, str]] = set()
        self._flow_labels: set[str] = set()

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Refresh every gauge at ``now`` (default: database clock); counts types and errors."""
        now = now or database_now(self.using)
        counts: Counter[str] = Counter()
        self._part(counts, "the backlog count", lambda: self._backlog(now, counts))
        self._part(counts, "the flow read", lambda: self._flow(now, counts))
        self._part(counts, "the table health read", lambda: self._health(counts))
        return counts

    def withdraw(self) -> None:
        """Stop exporting every gauge of this duty (this process no longer leads)."""
        for gauge in metrics.LEADER_GAUGES:
            gauge.clear()
        self._backlog_labels.clear()
        self._index_labels.clear()
        self._flow_labels.clear()
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

    def _flow(self, now: datetime, counts: Counter[str]) -> None:
        """Each flow-controlled or throttled type's running jobs, limit, tokens, throttle and
        held-back due jobs; types that no longer have any are withdrawn."""
        pauses = {
            p.value: p for p in queue.paused(using=self.using) if p.kind == PauseKind.JOB_TYPE
        }
        throttled = {name for name, p in pauses.items() if p.until is not None}
        names = set(self.limits) | throttled
        none = FlowLimits()
        states = flow_state.state({n: self.limits.get(n, none) for n in names}, using=self.using)
        for name in sorted(names):
            limits, state, pause = self.limits.get(name), states.get(name), pauses.get(name)
            tenants: list[TenantFlow] = []
            tokens: dict[str, float] = {}
            if limits is not None and limits.tenant_ordered and state is not None and state.due:
                tenants = flow_state.tenant_backlog(name, limit=TENANT_ROWS, using=self.using)
                if limits.tenant_rate is not None:
                    tokens = flow_state.tenant_tokens(
                        name, [t.tenant for t in tenants], limits, using=self.using
                    )
            held = held_back(limits, state, pause, tenants, tokens, now=now)
            metrics.flow_running.labels(name).set(state.running if state else 0)
            metrics.flow_limited.labels(name).set(held.jobs)
            if limits is not None and limits.global_concurrency is not None:
                metrics.flow_limit.labels(name).set(limits.global_concurrency)
            if state is not None and state.tokens is not None:
                metrics.flow_tokens.labels(name).set(max(0.0, state.tokens))
            until = pause.until if pause is not None else None
            left = (until - now).total_seconds() if until is not None else 0.0
            metrics.flow_throttled.labels(name).set(max(0.0, left))
        for name in self._flow_labels - names:
            for gauge in FLOW_GAUGES:
                _remove(gauge, name)
        self._flow_labels = names
        counts["flow"] = len(names)

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


#: The per-type flow gauges, withdrawn together for a type that no longer has flow control.
FLOW_GAUGES = (
    metrics.flow_running,
    metrics.flow_limit,
    metrics.flow_limited,
    metrics.flow_tokens,
    metrics.flow_throttled,
)


def _remove(gauge: Gauge, name: str) -> None:
    """Drop one type's series of a gauge, whether it had one or not."""
    with contextlib.suppress(KeyError):
        gauge.remove(name)


def _registered_limits(names: Collection[str]) -> dict[str, FlowLimits]:
    """The flow controls of the registered types among ``names``."""
    registry = get_registry()
    found = {}
    for name in names:
        job_type = registry.get(name)
        if job_type is not None and (limits := flow.limits_of(job_type.policy)) is not None:
            found[name] = limits
    return found
