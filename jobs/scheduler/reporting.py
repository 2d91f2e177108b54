"""Per-schedule status: the runs that happened, the next one due, and the ones that did not.

A schedule that silently stops firing is invisible unless something expects it. This module
holds that expectation: from each schedule's latest recorded slot it computes the next slot
due, and calls the schedule *overdue* once that slot is later than the misfire grace (it can
then only fire as a catch-up, or be skipped). A paused schedule is never overdue: nothing is
expected of it until it is resumed, and its next slot is the first after now. The admin shows
:func:`status`; every scheduler process, leader or standby, exports it as gauges. A
scheduler that is not running at all exports nothing: alert on
``absent(jobs_scheduler_leader == 1)`` (or on ``max(jobs_scheduler_leader) < 1``) as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.catalogue.schedules import Schedule, get_schedules
from jobs.db.clock import database_now
from jobs.scheduler import metrics, slots


@dataclass(frozen=True, slots=True)
class ScheduleStatus:
    """One schedule as the admin shows it. Times are aware datetimes (UTC)."""

    name: str
    job: str
    cron: str
    timezone: str
    misfire: str
    last_fired_slot: datetime | None  # the latest slot that enqueued a job
    last_fired_at: datetime | None  # when that slot was recorded
    last_job_id: str  # that slot's job_id ("" if none)
    last_skipped_slot: datetime | None  # the latest slot dropped by the misfire policy
    next_due: datetime  # the next slot that should fire
    overdue_seconds: float  # since next_due, once past the misfire grace; else 0
    last_job_pk: int | None = None  # the jobs row of that slot's job (None if none)
    paused: bool = False  # paused: no slot fires until it is resumed

    @property
    def overdue(self) -> bool:
        return self.overdue_seconds > 0


def status(
    *,
    now: datetime | None = None,
    schedules: Sequence[Schedule] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[ScheduleStatus]:
    """The status of every configured schedule, by name, at ``now`` (default: database clock).

    One query. Raises ``ImproperlyConfigured`` if the schedules are invalid.
    """
    schedules = get_schedules() if schedules is None else schedules
    if not schedules:
        return []
    now = now or database_now(using)
    with connections[using].cursor() as cur:
        found = slots.summaries(cur, [s.name for s in schedules])
    return [_status(schedule, found.get(schedule.name), now) for schedule in schedules]


def recent_slots(
    names: Sequence[str] | None = None, *, limit: int = 50, using: str = DEFAULT_DB_ALIAS
) -> list[slots.SlotRow]:
    """The latest ``limit`` slots recorded for these schedules (default: every configured one),
    newest first: fired, caught up and skipped. One query."""
    names = [s.name for s in get_schedules()] if names is None else list(names)
    if not names:
        return []
    with connections[using].cursor() as cur:
        return slots.recent(cur, names, limit=limit)


def export(statuses: Sequence[ScheduleStatus]) -> None:
    """Publish statuses as the ``jobs_schedule_*`` gauges."""
    for item in statuses:
        fired = item.last_fired_slot.timestamp() if item.last_fired_slot else 0
        metrics.last_fired.labels(item.name).set(fired)
        metrics.next_due.labels(item.name).set(item.next_due.timestamp())
        metrics.overdue.labels(item.name).set(item.overdue_seconds)


def _status(schedule: Schedule, summary: slots.SlotSummary | None, now: datetime) -> ScheduleStatus:
    summary = summary or slots.SlotSummary()
    grace = schedule.misfire_grace
    # With nothing recorded yet, the next slot is the one a first tick would fire: the current
    # slot while it is within the grace, else the next one, or the first from catch_up_from.
    if summary.paused:
        next_due = schedule.next_slot(now)  # the first a resume now would let fire
    elif summary.last_slot is not None:
        next_due = schedule.next_slot(summary.last_slot)
    else:
        next_due = schedule.first_due(now)
    late = (now - next_due).total_seconds()
    return ScheduleStatus(
        name=schedule.name,
        job=schedule.job,
        cron=schedule.cron,
        timezone=str(schedule.timezone),
        misfire=schedule.misfire,
        last_fired_slot=summary.last_fired_slot,
        last_fired_at=summary.last_fired_at,
        last_job_id=summary.last_job_id,
        last_skipped_slot=summary.last_skipped_slot,
        next_due=next_due,
        overdue_seconds=late if late > grace.total_seconds() else 0.0,
        last_job_pk=summary.last_job_pk,
        paused=summary.paused,
    )
