"""The scheduler's loop: contend for leadership, and while leading run each duty on its interval.

One thread owns the loop and Django's connection; the leadership keeper proves the lock on its
own thread and connection, and a stall guard watches the loop from a third::

    ┌─▶ standby: try the lock every standby interval; export schedule status gauges
    │            (and withdraw the backlog and table gauges: only the leader counts)
    │   leader:  read the database clock once, then for each due duty
    │              (cron and the release of waiting jobs every tick, watchdog,
    │              retention, archive, gauges): prove leadership → run_once(now)
    │            export schedule status gauges after each cron tick
    │   both:    every third of the leader timeout, and when leadership changes: beat the
    │            process's row in jobs_process (registered at start, deleted on a clean stop)
    └── wait for the next duty, attempt or beat (at most 1 s), or a stop signal

    guard: the loop has not moved (no pass, no statement started or finished) for
           SCHEDULER_LEADER_TIMEOUT ──▶ step down, abort the loop's connection (the stuck call
           raises), stay out of the contest for one timeout so a standby takes over

Every call has a bound (jobs.db.bounds): the loop's connection carries statement_timeout,
lock_timeout and TCP keepalives/tcp_user_timeout, the lock session's calls have a deadline,
and the guard catches what none of those can see (a path that went silent).

Each duty covers every database alias that holds jobs (:mod:`jobs.scheduler.per_database`):
the lock, the process row and the pass's clock are the home alias's (``JOBS["DATABASE"]``).

A duty that fails is logged and counted, and runs again on its next interval; a duty that finds
leadership lost stops the pass. Becoming leader runs every duty at once (a returning scheduler
clears stale work immediately). SIGTERM/SIGINT stop the loop after the current duty and release
leadership, so a standby takes over at its next attempt.

Over 400 lines because the loop, its stall guard and the leadership hand-over are one state
machine; each duty lives in its own module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from jobs.catalogue import routing as databases
from jobs.catalogue.registry import Registry, get_registry
from jobs.catalogue.schedules import Schedule, get_schedules
from jobs.db import bounds as dbbounds
from jobs.db.bounds import StallGuard
from jobs.db.clock import database_now
from jobs.db.sqlstate import unreachable
from jobs.runtime.process import Presence, install_stop_signals, restore_signals, start_http
from jobs.scheduler import metrics
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.cron import CronService
from jobs.scheduler.gauges import Gauges
from jobs.scheduler.leader import Leadership, LeadershipLost
from jobs.scheduler.per_database import Outages, PerDatabase, RecordedGauges
from jobs.scheduler.release import DependentsRelease
from jobs.scheduler.reporting import export, status
from jobs.scheduler.retention import Archive, Retention
from jobs.scheduler.watchdog import Watchdog

logger = logging.getLogger("jobs.scheduler")

CONTENDING = "contending for leadership"


@dataclass(frozen=True)
class OnceReport:
    """What one ``run_once`` did: whether it led, and which duties ran or failed."""

    led: bool
    reachable: bool  # False: it could not reach the database to contend for leadership
    ran: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()  # raised, reported errors, or lost leadership mid-pass


@dataclass
class Duty:
    """A maintenance service the leader runs every ``interval`` seconds."""

    name: str
    interval: float
    run: Callable[[datetime], object]
    next_at: float = 0.0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        schedules: Sequence[Schedule] | None = None,
        registry: Registry | None = None,
        leadership: Leadership | None = None,
    ) -> None:
        self.config = config = config or SchedulerConfig()
        self.schedules = tuple(get_schedules() if schedules is None else schedules)
        config.check_schedules(self.schedules)
        registry = registry or get_registry()
        # The lock, the process row and the pass's clock live on the home alias; the duties
        # visit every alias that holds jobs, the home one first.
        self.home = home = databases.home()
        aliases = (home, *(alias for alias in databases.configured() if alias != home))
        self.leadership = leadership or Leadership(
            config.identity, timeout=config.leader_duration, using=home
        )
        self.schedules_by_alias = _by_alias(self.schedules, aliases, registry)
        # Aliases found unreachable rest, for every duty at once (jobs.scheduler.per_database).
        self.outages = outages = Outages()
        self.cron = PerDatabase(
            "cron",
            {
                alias: CronService(
                    self.schedules_by_alias.get(alias, ()),
                    identity=config.identity,
                    fence=self.leadership.fence if alias == home else self._fence_elsewhere,
                    stall_timeout=config.leader_duration,
                    using=alias,
                )
                for alias in aliases
                if alias == home or alias in self.schedules_by_alias
            },
            home=home,
            outages=outages,
        )
        max_attempts = registry.max_attempts()
        self.watchdog = PerDatabase(
            "watchdog",
            {a: Watchdog(config.watchdog, max_attempts=max_attempts, using=a) for a in aliases},
            home=home,
            outages=outages,
        )
        self.retention = PerDatabase(
            "retention",
            {a: Retention(config.retention, using=a) for a in aliases},
            home=home,
            outages=outages,
        )
        self.archive = PerDatabase(
            "archive",
            {a: Archive(config.archive, using=a) for a in aliases},
            home=home,
            outages=outages,
        )
        self.release = PerDatabase(
            "release",
            {a: DependentsRelease(using=a) for a in aliases},
            home=home,
            outages=outages,
        )
        self.gauges = Gauges(databases.served(registry, home), using=home)
        gauges: dict[str, Gauges] = {home: self.gauges}
        for alias in aliases[1:]:
            gauges[alias] = RecordedGauges(databases.served(registry, alias), using=alias)
        self.aliases = aliases
        self.duties = [
            Duty("cron", config.tick_interval, self.cron.run_once),
            Duty("watchdog", config.watchdog_interval, self.watchdog.run_once),
            Duty("retention", config.retention_interval, self.retention.run_once),
            Duty("archive", config.archive_interval, self.archive.run_once),
            Duty("release", config.tick_interval, self.release.run_once),
            Duty(
                "gauges",
                config.gauge_interval,
                PerDatabase("gauges", gauges, home=home, outages=outages).run_once,
            ),
        ]
        self.passes = 0  # passes that ran duties as leader
        self.ready = False
        self.alive_at = time.monotonic()
        self.last_pass: dict[str, bool] = {}  # duty name -> it ran cleanly, in the last pass
        self._stop = threading.Event()
        self._next_attempt = 0.0
        self._status_failing = False
        self._activity: str | None = None  # what the loop is doing, for a stall's report
        # The row in jobs_process, refreshed every third of the leader timeout and whenever
        # leadership changes; a stuck loop stops beating and shows as gone.
        self.presence = Presence(
            config.identity,
            component="scheduler",
            expires_in=config.leader_duration.total_seconds(),
            logger=logger,
            using=home,
        )
        self._beat_every = config.leader_duration.total_seconds() / 3
        self._next_beat = 0.0
        self._beat_leader = False
        # The loop thread's (bounded) connections, the home alias's first.
        self._dbs: list[BaseDatabaseWrapper] = []

    def run(self, *, until: Callable[[Scheduler], bool] | None = None) -> int:
        """Run until stopped (or ``until(scheduler)`` is true after a pass); returns 0."""
        previous = install_stop_signals(self.request_stop, self.config.install_signal_handlers)
        server = start_http(
            self.config.http_host,
            self.config.http_port,
            healthy=lambda: self.healthy,
            ready=lambda: self.ready and not self._stop.is_set(),
        )
        logger.info(
            "scheduler %s started: schedules %s; watchdog every %gs, retention every %gs, "
            "archive every %gs",
            self.config.identity,
            ", ".join(s.name for s in self.schedules) or "(none)",
            self.config.watchdog_interval,
            self.config.retention_interval,
            self.config.archive_interval,
            extra={"action": "started"},
        )
        self.ready = True
        guard = StallGuard(
            self.config.leader_duration.total_seconds(), self._stalled, name="jobs-scheduler-guard"
        )
        try:
            with contextlib.ExitStack() as stack:
                # Every alias's connection of the loop is bounded and watched by the guard.
                self._dbs = []
                for alias in self.aliases:
                    db = stack.enter_context(
                        dbbounds.bounded(connections[alias], self._bounds(alias))
                    )
                    stack.enter_context(db.execute_wrapper(guard))
                    self._dbs.append(db)
                guard.start()
                self._activity = "registering in jobs_process"
                if self.presence.register():
                    self._next_beat = time.monotonic() + self._beat_every
                try:
                    while not self._stop.is_set():
                        self.alive_at = time.monotonic()
                        guard.moved()
                        self._pass()
                        if until is not None and until(self):
                            break
                        with guard.waiting():
                            self._stop.wait(self._wait_time())
                finally:  # on the bounded connection; kill -9 leaves the row to show as gone
                    self.presence.unregister()
            return 0
        finally:
            guard.stop()
            self.ready = False
            self.leadership.release()
            if server is not None:
                server.shutdown()
            for alias in self.aliases:
                connections[alias].close()
            restore_signals(previous)
            logger.info("scheduler %s stopped", self.config.identity, extra={"action": "stopped"})

    def run_once(self) -> OnceReport:
        """Try once to lead; if leading, run every duty once. Says what happened."""
        self.run(until=lambda _: True)
        return OnceReport(
            led=bool(self.last_pass),
            reachable=self.leadership.reachable,
            ran=tuple(name for name, ok in self.last_pass.items() if ok),
            failed=tuple(name for name, ok in self.last_pass.items() if not ok),
        )

    def request_stop(self) -> None:
        self._stop.set()

    def _stalled(self, seconds: float) -> None:
        """The loop has not moved for the leader timeout: stop leading, cut the stuck call.

        Runs on the guard's thread. Proving the lock from the keeper thread says nothing about
        the duties, so a loop stuck in a call (a lock wait with no bound, a silent network
        path) must not keep leadership; the standby takes over at its next attempt.
        """
        activity = self._activity or "between passes"
        visiting, visit = self.outages.visiting, self.outages.visits
        if visiting not in (None, self.home) and dbbounds.abort(self._db_of(visiting)):
            # Stuck on another alias's server: cut that call (it raises, and the alias rests);
            # the loop moves on at once and the home alias's work goes on, still led here.
            logger.warning(
                "scheduler %s aborted its connection to database %s, stuck in %s for %.1fs",
                self.config.identity,
                visiting,
                activity,
                seconds,
                extra={"action": "stuck_call_aborted", "database": visiting},
            )
            # Unless the loop was stuck on something else: still in that visit half a
            # timeout later, it gives up leading as for any other stall.
            grace = self.config.leader_duration.total_seconds() / 2
            later = threading.Timer(grace, self._still_stuck, args=(visit, seconds + grace))
            later.daemon = True
            later.start()
            return
        self._give_up(seconds, activity)

    def _still_stuck(self, visit: int, seconds: float) -> None:
        if self.outages.visits == visit and self.outages.visiting is not None:
            self._give_up(seconds, self._activity or "between passes")

    def _give_up(self, seconds: float, activity: str) -> None:
        """Stop leading and abort the loop's connections (the stuck call raises)."""
        if self.leadership.step_down(
            f"the scheduler loop has not moved for {seconds:.1f}s (stuck in {activity})"
        ):
            # Stand back for one timeout: a healthy standby takes over, instead of this
            # process winning the lock again the moment its call is cut, and sticking again.
            self._next_attempt = time.monotonic() + self.config.leader_duration.total_seconds()
        if self._activity == CONTENDING:
            return  # the lock connection's own calls have deadlines; Django's is idle
        # The stuck call is on one of them; aborting an idle one costs a reconnect.
        if any([dbbounds.abort(db) for db in self._dbs]):
            logger.warning(
                "scheduler %s aborted its database connection, stuck in %s for %.1fs",
                self.config.identity,
                activity,
                seconds,
                extra={"action": "stuck_call_aborted"},
            )

    @property
    def healthy(self) -> bool:
        slowest = max(self.config.tick_interval, self.config.standby_interval)
        return time.monotonic() - self.alive_at < max(30.0, 4 * slowest)

    # -- the loop ----------------------------------------------------------------------------

    def _pass(self) -> None:
        self._activity = None
        now = time.monotonic()
        if not self.leadership.leading and now >= self._next_attempt:
            self._next_attempt = now + self.config.standby_interval
            self._activity = CONTENDING
            if self.leadership.try_acquire():
                for duty in self.duties:
                    duty.next_at = 0.0
            else:
                self._export_status(None)
        if self.leadership.leading:
            self._lead()
        else:
            self.gauges.withdraw()  # a standby's figures would be stale: the leader's count
        self._beat()

    def _beat(self) -> None:
        """One small UPDATE every third of the leader timeout, and when leadership changes.

        It is a statement of its own: the one every scheduler makes often, the leadership
        proof, runs on the lock session, where a failing beat would cost leadership.
        """
        now, leading = time.monotonic(), self.leadership.leading
        if now < self._next_beat and leading == self._beat_leader:
            return
        self._activity = "beating in jobs_process"
        self._next_beat, self._beat_leader = now + self._beat_every, leading
        self.presence.send(leader=leading)  # a failure is logged; the next beat tries again

    def _lead(self) -> None:
        # Each due duty's next run counts from the pass's start, so duties of one interval stay
        # in step and share a wake-up rather than drifting into one pass each. A duty a stalled
        # pass left overdue runs in the next pass at once: cron catches up on its slots.
        started = time.monotonic()
        due = [duty for duty in self.duties if started >= duty.next_at]
        if not due:
            return
        self._activity = "reading the database clock"
        try:
            now = database_now(self.home)
        except Exception:
            logger.exception("cannot read the database clock; will try again")
            connections[self.home].close()
            return
        self.last_pass = {}
        for duty in due:
            if not self.leadership.prove():
                return
            duty.next_at = started + duty.interval
            self.last_pass[duty.name] = False
            self._activity = f"the {duty.name} pass"
            try:
                result = duty.run(now)
            except LeadershipLost as exc:
                logger.warning("%s pass abandoned: %s", duty.name, exc)
                self.leadership.prove()
                return
            except Exception:
                metrics.errors.labels(duty.name).inc()
                logger.exception("%s pass failed; will try again", duty.name)
                connections[self.home].close()
                continue
            self.last_pass[duty.name] = not _reported_errors(result)
            metrics.passes.labels(duty.name).inc()
            if duty.name == "cron":
                self._export_status(now)
        self.passes += 1

    def _export_status(self, now: datetime | None) -> None:
        if not self.schedules:
            return
        self._activity = "reading schedule status"
        failing = False
        for alias, schedules in self.schedules_by_alias.items():
            elsewhere = alias != self.home
            if elsewhere and self.outages.resting(alias):
                continue
            try:
                with self.outages.visit(alias):
                    export(status(now=None if elsewhere else now, schedules=schedules, using=alias))
            except Exception as exc:
                if not self._status_failing:
                    logger.warning("cannot read schedule status (database %s): %s", alias, exc)
                failing = True
                connections[alias].close()
                if elsewhere and unreachable(exc):
                    self.outages.gone(alias)
        self._status_failing = failing

    def _bounds(self, alias: str) -> dbbounds.Bounds:
        """The bounds of the loop's connection to ``alias``.

        Another alias's connection gives up connecting (and on a dead path) within half the
        leader timeout: the stall guard cannot cut a connect short, so a server gone silent
        would otherwise cost leadership instead of a rest.
        """
        bounds = dbbounds.Bounds.from_settings()
        network = bounds.network_timeout
        network = network.total_seconds() if isinstance(network, timedelta) else float(network)
        half = self.config.leader_duration.total_seconds() / 2
        if alias == self.home or not network or network <= half:
            return bounds
        return dataclasses.replace(bounds, network_timeout=max(1.0, half))

    def _db_of(self, alias: str) -> BaseDatabaseWrapper | None:
        """The loop's connection to ``alias`` (None outside :meth:`run`)."""
        return dict(zip(self.aliases, self._dbs, strict=False)).get(alias)

    def _fence_elsewhere(self, using: str) -> None:
        """The cron fence on another alias: the lock's session is on the home alias.

        Another server cannot see that session, so the tick proves leadership on the lock's
        own connection first; the slot's unique row on that alias is the last word, as ever.
        """
        if not self.leadership.prove():
            raise LeadershipLost(f"scheduler {self.config.identity} is not the leader")

    def _wait_time(self) -> float:
        if self.leadership.leading:
            target = min(duty.next_at for duty in self.duties)
        else:
            target = self._next_attempt
        target = min(target, self._next_beat)
        return max(0.0, min(target - time.monotonic(), 1.0))


def _by_alias(
    schedules: Sequence[Schedule], aliases: Sequence[str], registry: Registry
) -> dict[str, tuple[Schedule, ...]]:
    """Schedules by the alias their job type lives in (unbound: the home alias, first)."""
    found: dict[str, list[Schedule]] = {}
    for schedule in schedules:
        job_type = registry.get(schedule.job)
        alias = (job_type.policy.database if job_type else None) or aliases[0]
        if alias not in aliases:
            raise ImproperlyConfigured(
                f"schedule {schedule.name}: its job type {schedule.job} lives in database "
                f"{alias!r}, which JOBS['DATABASES'] leaves out ({', '.join(aliases)})"
            )
        found.setdefault(alias, []).append(schedule)
    return {alias: tuple(found[alias]) for alias in aliases if alias in found}


def _reported_errors(result: object) -> int:
    """Duties report failures they logged and went past as ``errors`` in their counts."""
    if isinstance(result, Mapping):
        return int(result.get("errors", 0))
    return int(getattr(result, "errors", 0))
