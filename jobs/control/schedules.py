"""Operate a schedule as an operator: run its job now, pause it, resume it. Checked and recorded.

The admin's schedules page and ``manage.py jobs`` come here.

* **Run now** (``jobs.run_schedule``) enqueues one extra job of the schedule's job type with its
  payload and tenant. It is not a slot: no slot row is written, the schedule's next slot
  fires as usual, and its ``job_id`` is ``run:<schedule>:<token>``, which no slot's
  ``cron:<schedule>:<slot>`` can equal. The token comes from the confirmation page, so
  the same confirmation posted twice enqueues once (the second finds the job holding the key).
  The job gets one ``LogEntry`` (an addition) under the operator, in the enqueue's transaction.
* **Pause / resume** (``jobs.pause_work``) are :mod:`jobs.control.pauses` for the ``schedule``
  kind: the scheduler fires no slot of a paused schedule, and a resume records the slots that
  came due meanwhile as skipped (:mod:`jobs.scheduler.pausing`).
* **Viewing** the schedules needs the view permission on schedule slots
  (``jobs.view_scheduleslot``) or on jobs (``jobs.view_job``, or ``jobs.change_job``).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from django.contrib.admin.models import ADDITION, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils.translation import gettext as _

from jobs.catalogue import routing as databases
from jobs.catalogue.schedules import Schedule, get_schedules
from jobs.control import pauses
from jobs.control.tables import Operator, RunTable
from jobs.models import Job, PauseKind

RUN_PERMISSION = "jobs.run_schedule"
VIEW_PERMISSION = "jobs.view_scheduleslot"
_TOKEN = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class RunNow:
    """The job a *Run now* enqueued, or found already enqueued by the same confirmation."""

    schedule: str
    job: int
    job_id: str
    created: bool


def can_view(user: Operator) -> bool:
    return user.has_perm(VIEW_PERMISSION) or RunTable(Job).can_view(user)


def can_run(user: Operator) -> bool:
    return user.has_perm(RUN_PERMISSION)


def can_pause(user: Operator) -> bool:
    return pauses.can_pause(user)


def find(name: str) -> Schedule:
    """The configured schedule ``name``; ValueError when there is none."""
    for schedule in get_schedules():
        if schedule.name == name:
            return schedule
    raise ValueError(_("No schedule named %(name)s is configured.") % {"name": name})


def new_token() -> str:
    """A fresh *Run now* token, for one confirmation page (or one command)."""
    return secrets.token_hex(16)


def run_job_id(name: str, token: str) -> str:
    """The job_id of a *Run now*: ``run:`` where every slot's is ``cron:``."""
    return f"run:{name}:{token}"


def run_now(user: Operator, name: str, *, token: str, via: str) -> RunNow:
    """Enqueue one extra job of the schedule ``name`` (no slot), once per ``token``.

    Raises ``PermissionDenied`` without ``jobs.run_schedule``, ``ValueError`` for a schedule
    that is not configured or a malformed token. Runs whether or not the schedule is paused:
    a pause holds back slots, and this is not one.
    """
    from jobs.api.producer import enqueue

    if not can_run(user):
        raise PermissionDenied(
            _("You may not run schedules now (needs the %(perm)s permission).")
            % {"perm": RUN_PERMISSION}
        )
    schedule = find(name)
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError(_("That confirmation is not valid: ask again."))
    job_id = run_job_id(name, token)
    using = databases.bound(schedule.job) or databases.home()  # where its slots fire
    with transaction.atomic(), transaction.atomic(using=using):
        job = enqueue(schedule.payload, job_id=job_id, tenant=schedule.tenant, using=using)
        if job.created:
            LogEntry.objects.log_actions(
                user.pk,
                [Job.objects.using(using).get(pk=job.id)],
                ADDITION,
                change_message=f"Ran schedule {name} now via {via}: job {job_id}",
            )
    return RunNow(name, job.id, job_id, job.created)


def pause(user: Operator, name: str, *, reason: str = "", via: str) -> bool:
    """Pause the configured schedule ``name``; False when it was paused already.

    Refused (ValueError) for a schedule that fires in another database: the scheduler reads
    its pauses there, so a pause recorded here would hold nothing back.
    """
    where = databases.bound(find(name).job)
    if where is not None and where != DEFAULT_DB_ALIAS:
        raise ValueError(
            _(
                "Schedule %(name)s fires in database %(database)s, whose pauses the scheduler "
                "reads there: it cannot be paused from here."
            )
            % {"name": name, "database": where}
        )
    return pauses.pause(user, PauseKind.SCHEDULE, name, reason=reason, via=via)


def resume(user: Operator, name: str, *, via: str) -> bool:
    """Resume the schedule ``name``; False when it was not paused.

    Not limited to configured schedules: a pause left behind by a removed one can go too.
    """
    return pauses.resume(user, PauseKind.SCHEDULE, name, via=via)
