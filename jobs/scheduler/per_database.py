"""One duty, every database: the leader runs each maintenance duty on every jobs alias.

The scheduler leads once, through its lock on the home alias (``JOBS["DATABASE"]``); what it
does while leading must reach every alias that holds jobs (:func:`jobs.databases.configured`)::

    duty pass ──▶ home alias   at the pass's database time
              ──▶ other alias  at that database's own clock (another server's may differ)
              ──▶ …            a failure on one alias is logged and counted, the next still runs

With a single alias the duty is the service itself, unchanged. Cron goes to the alias where
each schedule's job type lives, so a slot row and its job commit in one transaction there.
Prometheus gauges are the home alias's: the other aliases' backlog is counted and recorded
for their console, and their unsupported names are logged, but not exported, since two
databases' figures under the same labels would overwrite each other.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Protocol

from django.db import connections

from jobs import queue
from jobs.scheduler import metrics
from jobs.scheduler.clock import database_now
from jobs.scheduler.gauges import Gauges
from jobs.scheduler.leader import LeadershipLost

logger = logging.getLogger("jobs.scheduler")


class Service(Protocol):
    def run_once(self, now: datetime | None = None) -> object: ...


class PerDatabase:
    """A duty's services by alias, home first; ``run_once`` visits each and merges counts."""

    def __init__(self, duty: str, services: Mapping[str, Service], *, home: str) -> None:
        self.duty = duty
        self.services = dict(services)
        self.home = home

    def run_once(self, now: datetime | None = None) -> object:
        """Run the duty on every alias; counts summed, ``errors`` counting failed aliases.

        ``now`` is the home alias's time; another alias's service reads its own clock.
        Losing leadership stops the pass at once, as in a single database.
        """
        if len(self.services) == 1:
            [service] = self.services.values()
            return service.run_once(now)
        counts: Counter[str] = Counter()
        for alias, service in self.services.items():
            try:
                result = service.run_once(now if alias == self.home else None)
            except LeadershipLost:
                raise
            except Exception:
                counts["errors"] += 1
                metrics.errors.labels(self.duty).inc()
                logger.exception(
                    "%s pass on database %s failed; will try again",
                    self.duty,
                    alias,
                    extra={"action": "duty_failed", "duty": self.duty, "database": alias},
                )
                with contextlib.suppress(Exception):
                    connections[alias].close()
                continue
            counts.update(_counts(result))
        return counts

    def __getitem__(self, alias: str) -> Service:
        return self.services[alias]


class RecordedGauges(Gauges):
    """The gauges duty of an alias other than the home one: record, log, export nothing."""

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        now = now or database_now(self.using)
        counts: Counter[str] = Counter()
        self._part(counts, "the backlog count", lambda: self._recorded(now, counts))
        return counts

    def withdraw(self) -> None:
        """Nothing exported, nothing to withdraw."""

    def _recorded(self, now: datetime, counts: Counter[str]) -> None:
        rows = queue.backlog(supported=self.names, using=self.using)
        self._warn_unsupported(rows)
        self._record_backlog(rows, now)
        counts["types"] = len(rows)


def _counts(result: object) -> Mapping[str, int]:
    """A service's result as counts: a Counter already, or a dataclass of ints (cron's)."""
    if isinstance(result, Mapping):
        return result
    if is_dataclass(result) and not isinstance(result, type):
        return {f.name: int(getattr(result, f.name)) for f in fields(result)}
    return {}
