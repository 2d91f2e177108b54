"""One duty, every database: the leader runs each maintenance duty on every jobs alias.

The scheduler leads once, through its lock on the home alias (``JOBS["DATABASE"]``); what it
does while leading must reach every alias that holds jobs
(:func:`jobs.catalogue.routing.configured`)::

    duty pass ──▶ home alias   at the pass's database time
              ──▶ other alias  at that database's own clock (another server's may differ)
              ──▶ …            a failure on one alias is logged and counted, the next still runs

With a single alias the duty is the service itself, unchanged. Cron goes to the alias where
each schedule's job type lives, so a slot row and its job commit in one transaction there.

Prometheus gauges are the home alias's: the other aliases' backlog is counted and recorded
for their console, and their unsupported names are logged, but not exported, since two
databases' figures under the same labels would overwrite each other.

An alias other than the home one that cannot be reached *rests* (:class:`Outages`): every
duty passes it over for a few seconds, doubling while it stays away, up to a minute. A
server that stops answering costs the loop a stall (cut by a bound, or by the stall guard)
once per rest, not once per duty and pass; the home alias's work goes on between.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Protocol

from django.db import connections

from jobs import queue
from jobs.db.clock import database_now
from jobs.db.sqlstate import unreachable
from jobs.scheduler import metrics
from jobs.scheduler.gauges import Gauges
from jobs.scheduler.leader import LeadershipLost

logger = logging.getLogger("jobs.scheduler")


class Service(Protocol):
    def run_once(self, now: datetime | None = None) -> object: ...


class Outages:
    """The aliases (not the home one) found unreachable lately, and the one being visited.

    Shared by every duty of a scheduler, so an alias found gone by one duty is passed over
    by the others until its rest ends; the stall guard reads :attr:`visiting` to cut a call
    stuck there without giving up leadership.
    """

    #: Seconds an alias rests after it was found unreachable; doubled while it stays away.
    REST = 5.0
    REST_MAX = 60.0

    def __init__(self) -> None:
        self.visiting: str | None = None
        self.visits = 0  # tells one visit of an alias from the next
        self._until: dict[str, float] = {}
        self._streak: Counter[str] = Counter()

    @contextlib.contextmanager
    def visit(self, alias: str) -> Iterator[None]:
        """The loop is working on ``alias`` (for the stall guard) while in this block."""
        self.visiting = alias
        self.visits += 1
        try:
            yield
        finally:
            self.visiting = None

    def resting(self, alias: str) -> bool:
        return time.monotonic() < self._until.get(alias, 0.0)

    def gone(self, alias: str) -> float:
        """``alias`` could not be reached: it rests; returns for how many seconds."""
        self._streak[alias] += 1
        rest: float = min(self.REST_MAX, self.REST * 2.0 ** (self._streak[alias] - 1))
        self._until[alias] = time.monotonic() + rest
        return rest

    def reached(self, alias: str) -> None:
        if self._streak.pop(alias, 0):
            self._until.pop(alias, None)
            logger.info("database %s is reachable again", alias, extra={"action": "database_back"})


class PerDatabase:
    """A duty's services by alias, home first; ``run_once`` visits each and merges counts."""

    def __init__(
        self,
        duty: str,
        services: Mapping[str, Service],
        *,
        home: str,
        outages: Outages | None = None,
    ) -> None:
        self.duty = duty
        self.services = dict(services)
        self.home = home
        self.outages = outages or Outages()

    def run_once(self, now: datetime | None = None) -> object:
        """Run the duty on every alias; counts summed, ``errors`` counting failed aliases.

        ``now`` is the home alias's time; another alias's service reads its own clock.
        Losing leadership stops the pass at once, as in a single database.
        """
        if len(self.services) == 1:
            [service] = self.services.values()
            return service.run_once(now)
        counts: Counter[str] = Counter()
        outages = self.outages
        for alias, service in self.services.items():
            home = alias == self.home
            if not home and outages.resting(alias):
                counts["errors"] += 1  # not done there: --once reports the duty failed
                continue
            try:
                with outages.visit(alias):
                    result = service.run_once(now if home else None)
            except LeadershipLost:
                raise
            except Exception as exc:
                counts["errors"] += 1
                metrics.errors.labels(self.duty).inc()
                rest = (
                    "" if home or not unreachable(exc) else f"; it rests {outages.gone(alias):g}s"
                )
                logger.exception(
                    "%s pass on database %s failed%s; will try again",
                    self.duty,
                    alias,
                    rest,
                    extra={"action": "duty_failed", "duty": self.duty, "database": alias},
                )
                with contextlib.suppress(Exception):
                    connections[alias].close()
                continue
            if not home:
                outages.reached(alias)
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
