"""Cancel jobs as an operator: queued ones end at once, running ones are asked to stop.

The admin and ``manage.py jobs cancel`` both come here. The operator needs the
``jobs.cancel_job`` permission; the queue makes the changes in one conditional statement
(:func:`jobs.queue.cancel_active`: queued jobs end, running ones are asked to stop; a job
moving between the two meanwhile is handled in the state it reached, and two operators at
once act once) and every job acted on gets one ``LogEntry`` under the
operator, in the same transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models import Q, QuerySet
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from jobs import queue
from jobs.control.tables import Operator
from jobs.models import Job
from jobs.runs import ACTIVE_STATES

PERMISSION = "jobs.cancel_job"
#: Jobs one bulk cancel may act on; narrow the filter for more.
CANCEL_ALL_LIMIT = 1000


@dataclass(frozen=True)
class Cancelled:
    """What a cancel did: queued jobs ended, running jobs asked to stop, the rest left alone."""

    ended: tuple[int, ...]
    stopping: tuple[int, ...]
    untouched: tuple[int, ...]

    def summary(self) -> str:
        parts = []
        if self.ended:
            n = len(self.ended)
            parts.append(
                ngettext("Cancelled %(count)d queued job.", "Cancelled %(count)d queued jobs.", n)
                % {"count": n}
            )
        if self.stopping:
            n = len(self.stopping)
            parts.append(
                ngettext(
                    "Asked %(count)d running job to stop; it ends cancelled within a third "
                    "of its lease.",
                    "Asked %(count)d running jobs to stop; they end cancelled within a third "
                    "of their lease.",
                    n,
                )
                % {"count": n}
            )
        if self.untouched:
            n = len(self.untouched)
            parts.append(
                ngettext(
                    "%(count)d job was left alone: it had finished or was asked already.",
                    "%(count)d jobs were left alone: they had finished or were asked already.",
                    n,
                )
                % {"count": n}
            )
        return " ".join(parts) or _("Nothing to cancel.")


def can_cancel(user: Operator) -> bool:
    return user.has_perm(PERMISSION)


def cancel(
    user: Operator, ids: Iterable[int], *, via: str, using: str = DEFAULT_DB_ALIAS
) -> Cancelled:
    """Cancel the queued and running jobs among ``ids`` (in the alias ``using``) as ``user``.

    The log entries are written where the admin keeps them; on another alias they say which.
    """
    if not can_cancel(user):
        raise PermissionDenied(
            _("You may not cancel jobs (needs the %(perm)s permission).") % {"perm": PERMISSION}
        )
    wanted = sorted(set(ids))
    by = user.get_username()
    where = "" if using == DEFAULT_DB_ALIAS else f" (database {using})"
    with transaction.atomic(), transaction.atomic(using=using):
        ended, stopping = queue.cancel_active(wanted, by=by, using=using)
        for acted, message in ((ended, "Cancelled"), (stopping, "Asked to stop (running)")):
            if acted:
                LogEntry.objects.log_actions(
                    user.pk,
                    Job.objects.using(using).filter(pk__in=acted).order_by("pk"),
                    CHANGE,
                    change_message=f"{message} via {via}{where}",
                )
    done = set(ended) | set(stopping)
    return Cancelled(
        ended=tuple(ended),
        stopping=tuple(stopping),
        untouched=tuple(i for i in wanted if i not in done),
    )


def matching(
    *,
    job_type: str = "",
    tenant: str = "",
    queue_name: str = "",
    state: str = "",
    using: str = DEFAULT_DB_ALIAS,
) -> QuerySet[Job]:
    """Active jobs matching a filter in the alias ``using``, newest first (what a bulk cancel
    acts on)."""
    rows = Job.objects.using(using).filter(state__in=[state] if state else ACTIVE_STATES)
    condition = Q()
    if job_type:
        condition &= Q(name=job_type)
    if tenant:
        condition &= Q(tenant=tenant)
    if queue_name:
        condition &= Q(queue=queue_name)
    return rows.filter(condition).order_by("-pk")
