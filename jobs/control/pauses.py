"""Pause and resume job types, queues, tenants and schedules as an operator, checked and recorded.

The admin and ``manage.py jobs pause|resume`` both come here: the operator needs the
``jobs.pause_work`` permission, the change is made by :mod:`jobs.queue.pauses` (which every
worker's claim reads), and each change that happened gets one ``LogEntry`` under the
operator, in the same transaction. Pausing what is paused, or resuming what is not, changes
nothing and records nothing. A schedule resumes through :func:`jobs.scheduler.pausing.resume`,
which records the slots it let pass as skipped.
"""

from __future__ import annotations

from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils.translation import gettext as _

from jobs import queue
from jobs.catalogue import routing as databases
from jobs.control.tables import Operator
from jobs.models import Pause, PauseKind
from jobs.scheduler import pausing

PERMISSION = "jobs.pause_work"


def can_pause(user: Operator) -> bool:
    return user.has_perm(PERMISSION)


def _require(user: Operator) -> None:
    if not can_pause(user):
        raise PermissionDenied(
            _("You may not pause or resume work (needs the %(perm)s permission).")
            % {"perm": PERMISSION}
        )


def _where(kind: str, using: str) -> str:
    """How a log entry names another alias; a schedule's pause is refused there."""
    if using == DEFAULT_DB_ALIAS:
        return ""
    if kind == PauseKind.SCHEDULE:
        raise ValueError(
            f"schedules are paused in the {DEFAULT_DB_ALIAS!r} database only, not {using!r}"
        )
    return f" (database {using})"


def refusal(kind: str, value: str, using: str = DEFAULT_DB_ALIAS) -> str | None:
    """Why a pause of ``value`` recorded in ``using`` would hold nothing back (None: it would).

    A pause is read where the work happens: by the claims of the workers of its database, and
    for a schedule by the ticks in the database its job type lives in.
    """
    from jobs.catalogue.schedules import get_schedules

    if using not in databases.configured():
        return (
            f"database {using} holds no jobs (JOBS['DATABASES'] is "
            f"{', '.join(databases.configured())}): no worker would read a pause there"
        )
    if kind == PauseKind.JOB_TYPE:
        where = databases.bound(value)
        if where is not None and where != using:
            return (
                f"job type {value} lives in database {where}, whose workers read its pauses "
                f"there: pause it there (manage.py jobs --database {where} pause job_type "
                f"{value})"
            )
    if kind == PauseKind.SCHEDULE:
        for schedule in get_schedules():
            where = databases.bound(schedule.job) or databases.home()
            if schedule.name == value and where != using:
                return (
                    f"schedule {value}'s job type lives in database {where}, where its slots "
                    f"fire and its pauses are read: it cannot be paused in {using}"
                )
    return None


def pause(
    user: Operator,
    kind: str,
    value: str,
    *,
    reason: str = "",
    via: str,
    using: str = DEFAULT_DB_ALIAS,
) -> bool:
    """Pause ``value`` (a job type, queue or tenant) in the alias ``using``; False when it was
    paused already. The log entry is written where the admin keeps it, naming the alias.

    Raises ``ValueError`` for a kind or value that cannot be paused, and for a pause that
    would hold nothing back there (:func:`refusal`).
    """
    _require(user)
    if (why := refusal(kind, value, using)) is not None:
        raise ValueError(why)
    where = _where(kind, using)
    with transaction.atomic(), transaction.atomic(using=using):
        changed = queue.pause(kind, value, by=user.get_username(), reason=reason, using=using)
        if changed:
            row = Pause.objects.using(using).get(kind=kind, value=value)
            message = f"Paused via {via}{where}" + (f": {reason}" if reason else "")
            LogEntry.objects.log_actions(user.pk, [row], ADDITION, change_message=message)
    return changed


def resume(
    user: Operator, kind: str, value: str, *, via: str, using: str = DEFAULT_DB_ALIAS
) -> bool:
    """Resume a paused job type, queue, tenant or schedule (in the alias ``using``); False
    when it was not paused."""
    _require(user)
    where = _where(kind, using)
    with transaction.atomic(), transaction.atomic(using=using):
        row = Pause.objects.using(using).select_for_update().filter(kind=kind, value=value).first()
        message = f"Resumed via {via}{where}"
        if kind == PauseKind.SCHEDULE:
            resumed = pausing.resume(value, by=f"resumed by {user.get_username()}")
            changed, skipped = resumed.resumed, resumed.skipped
            if skipped is not None:
                message += (
                    f"; slots {(skipped.missed_from or skipped.slot).isoformat()} to "
                    f"{skipped.slot.isoformat()} recorded as skipped"
                )
        else:
            changed = queue.resume(kind, value, using=using)
        if changed and row is not None:
            LogEntry.objects.log_actions(user.pk, [row], DELETION, change_message=message)
    return changed
