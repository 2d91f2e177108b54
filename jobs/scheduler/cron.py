"""The cron duty: turn due slots into jobs, each slot recorded in the transaction that enqueues it.

One tick of one schedule is one transaction::

    (idle timeout) → fence (still the leader?) → lock the schedule → read its latest slot
      → plan (on time / catch-up / skipped, see jobs.catalogue.timing)
      → per slot: INSERT slot ON CONFLICT DO NOTHING; if inserted and it fires, enqueue the
        job with job_id "cron:<schedule>:<slot>" → commit

A crash anywhere before the commit leaves neither the slot nor its job, so the next tick fires
it; once committed, the slot row stops any other tick from firing it again.

A pass reads the paused schedules first (one query for all of them) and does not tick those:
they record nothing while paused. Their resume records the slots that came due meanwhile as
skipped (:mod:`jobs.scheduler.pausing`), so the next tick fires the next slot on time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from jobs.catalogue.schedules import Schedule
from jobs.catalogue.timing import Decision
from jobs.db.clock import database_now
from jobs.models import SlotKind
from jobs.scheduler import metrics, slots
from jobs.scheduler.leader import LeadershipLost
from jobs.scheduler.slots import PAUSED_KIND

logger = logging.getLogger("jobs.scheduler")


@dataclass(frozen=True, slots=True)
class Fired:
    """A slot this tick recorded; ``job`` is the jobs row id (None for a skipped slot)."""

    schedule: str
    decision: Decision
    job_id: str
    job: int | None
    created: bool


@dataclass(frozen=True, slots=True)
class CronCounts:
    on_time: int = 0
    catch_up: int = 0
    skipped: int = 0
    errors: int = 0
    paused: int = 0  # schedules not ticked because they are paused

    def __bool__(self) -> bool:
        return any((self.on_time, self.catch_up, self.skipped, self.errors))


class CronService:
    """Fires the slots of a fixed set of schedules; ``fence`` guards each tick's transaction."""

    def __init__(
        self,
        schedules: Sequence[Schedule],
        *,
        identity: str,
        fence: Callable[[str], None] | None = None,
        stall_timeout: timedelta | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self.schedules = tuple(schedules)
        self.identity = identity
        self.fence = fence
        # A leader stopped mid-tick (SIGSTOP) must not hold the schedule's lock forever: the
        # server ends a tick transaction left idle this long, and the new leader proceeds.
        self.stall_timeout = stall_timeout
        self.using = using

    def run_once(self, now: datetime | None = None) -> CronCounts:
        """Tick every schedule at ``now`` (default: the database clock); counts by kind.

        A failing schedule is logged and counted and the others still tick; losing
        leadership stops the pass. Paused schedules are passed over.
        """
        from jobs.queue.pauses import paused_values

        now = now or database_now(self.using)
        fired: list[Fired] = []
        errors = 0
        paused = paused_values(PAUSED_KIND, using=self.using) if self.schedules else {}
        for schedule in self.schedules:
            if schedule.name in paused:
                continue
            try:
                fired.extend(self.tick(schedule, now))
            except LeadershipLost:
                raise
            except Exception:
                errors += 1
                logger.exception(
                    "schedule %s: tick failed; it will be tried again",
                    schedule.name,
                    extra={"action": "tick_failed", "schedule": schedule.name},
                )
        kinds = [f.decision.kind for f in fired]
        return CronCounts(
            kinds.count(SlotKind.ON_TIME),
            kinds.count(SlotKind.CATCH_UP),
            kinds.count(SlotKind.SKIPPED),
            errors,
            sum(1 for schedule in self.schedules if schedule.name in paused),
        )

    def tick(self, schedule: Schedule, now: datetime) -> list[Fired]:
        """Plan and record one schedule's due slots in one transaction."""
        with transaction.atomic(using=self.using):
            with connections[self.using].cursor() as cur:
                if self.stall_timeout is not None:
                    milliseconds = int(self.stall_timeout.total_seconds() * 1000)
                    cur.execute(
                        "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                        [str(milliseconds)],
                    )
            if self.fence is not None:
                self.fence(self.using)
            with connections[self.using].cursor() as cur:
                slots.lock_schedule(cur, schedule.name)
                last = slots.last_recorded(cur, schedule.name)
            fired = self.record(schedule, schedule.plan(now, last))
        for item in fired:
            self._report(schedule, item)
        return fired

    def record(self, schedule: Schedule, decisions: Sequence[Decision]) -> list[Fired]:
        """Record each decision's slot and enqueue the job of each that fires.

        A slot already recorded (by anyone, ever) is passed over: that conflict, not the
        timing of the callers, is what keeps a slot from firing twice.
        """
        from jobs.api.producer import enqueue

        fired: list[Fired] = []
        with transaction.atomic(using=self.using), connections[self.using].cursor() as cur:
            for decision in decisions:
                job_id = schedule.job_id(decision.slot) if decision.fires else ""
                row = slots.record(cur, schedule.name, decision, job_id=job_id, by=self.identity)
                if row is None:
                    logger.debug("schedule %s: slot %s recorded already", schedule.name, job_id)
                    continue
                if not decision.fires:
                    fired.append(Fired(schedule.name, decision, "", None, False))
                    continue
                job = enqueue(
                    schedule.payload, job_id=job_id, tenant=schedule.tenant, using=self.using
                )
                slots.attach_job(cur, row, job.id)
                fired.append(Fired(schedule.name, decision, job_id, job.id, job.created))
        return fired

    def _report(self, schedule: Schedule, item: Fired) -> None:
        decision = item.decision
        metrics.slots.labels(schedule.name, decision.kind).inc()
        extra = {
            "action": f"slot_{decision.kind}",
            "schedule": schedule.name,
            "slot": decision.slot.isoformat(),
            "job_id": item.job_id,
        }
        if decision.kind == SlotKind.ON_TIME:
            logger.info(
                "schedule %s fired slot %s: job %s (row %s)",
                schedule.name,
                decision.slot.isoformat(),
                item.job_id,
                item.job,
                extra=extra,
            )
        elif decision.kind == SlotKind.CATCH_UP:
            covers = _covers(decision)
            logger.warning(
                "schedule %s caught up on missed slot %s%s (misfire %s): job %s (row %s)",
                schedule.name,
                decision.slot.isoformat(),
                covers,
                schedule.misfire,
                item.job_id,
                item.job,
                extra=extra,
            )
        else:
            logger.warning(
                "schedule %s skipped missed slots from %s to %s (misfire %s): no job",
                schedule.name,
                (decision.missed_from or decision.slot).isoformat(),
                decision.slot.isoformat(),
                schedule.misfire,
                extra=extra,
            )
        if decision.fires and not item.created:
            logger.warning(
                "schedule %s: job_id %s was already held by job row %s; no new job",
                schedule.name,
                item.job_id,
                item.job,
                extra=extra,
            )


def _covers(decision: Decision) -> str:
    if decision.missed_from is None or decision.missed_from == decision.slot:
        return ""
    return f" (standing for the slots since {decision.missed_from.isoformat()})"
