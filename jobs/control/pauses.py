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
from django.db import transaction
from django.utils.translation import gettext as _

from jobs import queue
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


def pause(user: Operator, kind: str, value: str, *, reason: str = "", via: str) -> bool:
    """Pause ``value`` (a job type, queue or tenant); False when it was paused already.

    Raises ``ValueError`` for a kind or value that cannot be paused.
    """
    _require(user)
    with transaction.atomic():
        changed = queue.pause(kind, value, by=user.get_username(), reason=reason)
        if changed:
            row = Pause.objects.get(kind=kind, value=value)
            message = f"Paused via {via}" + (f": {reason}" if reason else "")
            LogEntry.objects.log_actions(user.pk, [row], ADDITION, change_message=message)
    return changed


def resume(user: Operator, kind: str, value: str, *, via: str) -> bool:
    """Resume a paused job type, queue, tenant or schedule; False when it was not paused."""
    _require(user)
    with transaction.atomic():
        row = Pause.objects.select_for_update().filter(kind=kind, value=value).first()
        message = f"Resumed via {via}"
        if kind == PauseKind.SCHEDULE:
            resumed = pausing.resume(value, by=f"resumed by {user.get_username()}")
            changed, skipped = resumed.resumed, resumed.skipped
            if skipped is not None:
                message += (
                    f"; slots {(skipped.missed_from or skipped.slot).isoformat()} to "
                    f"{skipped.slot.isoformat()} recorded as skipped"
                )
        else:
            changed = queue.resume(kind, value)
        if changed and row is not None:
            LogEntry.objects.log_actions(user.pk, [row], DELETION, change_message=message)
    return changed
