"""Resume a paused schedule without a burst: the slots it let pass are recorded as skipped.

A paused schedule is a ``schedule`` row in the pauses table (:mod:`jobs.queue.pauses`); the
cron duty does not tick it, so nothing is recorded while it is paused. Resuming it, in one
transaction::

    lock the pause row → delete it → lock the schedule (as a tick does) → read its latest slot
      → one ``skipped`` row standing for every slot after that one (or since the pause began,
        for a schedule that never recorded one) up to now → commit

Without that row the next tick would take the paused stretch for downtime and apply the
misfire policy (``all`` fires up to ``max_catch_up`` jobs at once). With it, the next slot fires
on time and the stretch is on record, like slots the misfire policy dropped. A slot wanted
anyway is one *Run now* away. A schedule this process does not configure is only resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from jobs.catalogue.schedules import get_schedules
from jobs.catalogue.timing import Decision
from jobs.db.clock import database_now
from jobs.scheduler import slots


@dataclass(frozen=True, slots=True)
class Resumed:
    """What resuming a schedule did; false when it was not paused."""

    resumed: bool
    skipped: Decision | None = None  # the row standing for the slots let pass, if any

    def __bool__(self) -> bool:
        return self.resumed


def resume(
    name: str, *, by: str, now: datetime | None = None, using: str = DEFAULT_DB_ALIAS
) -> Resumed:
    """Resume the schedule ``name`` and record the slots that came due while it was paused,
    up to ``now`` (default: the database clock); ``by`` is written as the row's recorder."""
    from jobs.models import PauseKind
    from jobs.queue import pauses

    with transaction.atomic(using=using):
        since = pauses.paused_values(PauseKind.SCHEDULE, lock=True, using=using).get(name)
        if since is None or not pauses.resume(PauseKind.SCHEDULE, name, using=using):
            return Resumed(False)
        schedule = next((s for s in get_schedules() if s.name == name), None)
        if schedule is None:
            return Resumed(True)
        with connections[using].cursor() as cur:
            slots.lock_schedule(cur, name)
            last = slots.last_recorded(cur, name)
            decision = schedule.skipped_while_paused(
                last=last, since=since, now=now or database_now(using)
            )
            if decision is not None and slots.record(cur, name, decision, job_id="", by=by):
                return Resumed(True, decision)
    return Resumed(True)
