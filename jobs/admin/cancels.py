"""Cancel from the admin: what the confirmation says, and the job page's "Cancel…" view.

Both the jobs list's action and the job page call :func:`jobs.control.cancels.cancel`,
which checks ``jobs.cancel_job``, makes the change through the queue (conditional updates:
a double POST acts once) and records one ``LogEntry`` per job acted on.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from jobs.admin.databases import chosen, query
from jobs.admin.display import moment, now_of
from jobs.control import cancels
from jobs.control.tables import RunTable
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.runs import RunState

#: The jobs a cancel acts on: queued ones, and running ones not asked to stop yet.
ELIGIBLE = Q(state=RunState.QUEUED) | Q(state=RunState.RUNNING, cancel_requested_at__isnull=True)


def eligible(job: Job) -> bool:
    """Whether a cancel would act on this job as loaded (:data:`ELIGIBLE` for one row)."""
    return job.state == RunState.QUEUED or (
        job.state == RunState.RUNNING and job.cancel_requested_at is None
    )


def effects(queued: int, running: int) -> list[str]:
    """What the confirming POST does to each kind of job, for the confirmation page."""
    notes = []
    if queued:
        notes.append(
            ngettext(
                "%(count)d queued job ends cancelled now: it will not run, and its job_id "
                "is released.",
                "%(count)d queued jobs end cancelled now: they will not run, and their "
                "job_ids are released.",
                queued,
            )
            % {"count": queued}
        )
    if running:
        notes.append(
            ngettext(
                "%(count)d running job is asked to stop: its worker learns of it at its next "
                "lease renewal (within a third of the lease), and the attempt ends cancelled, "
                "not retried. A handler that ignores the request keeps its slot until it "
                "returns.",
                "%(count)d running jobs are asked to stop: each worker learns of it at its "
                "next lease renewal (within a third of the lease), and the attempts end "
                "cancelled, not retried. A handler that ignores the request keeps its slot "
                "until it returns.",
                running,
            )
            % {"count": running}
        )
    return notes


def cancel_view(
    request: HttpRequest,
    object_id: str,
    *,
    model_admin: admin.ModelAdmin,  # type: ignore[type-arg]  # generic in the stubs only
) -> HttpResponse:
    """The job page's "Cancel…": a confirmation (GET), then the confirming POST cancels.

    The page shows the job (type, job_id, state, worker), so, like replay's confirmation, it
    needs the view permission on jobs as well as ``jobs.cancel_job``.
    """
    if not cancels.can_cancel(request.user):
        raise PermissionDenied
    if not RunTable(Job).can_view(request.user):
        raise PermissionDenied(_("You may not view jobs."))
    job = model_admin.get_object(request, unquote(object_id))
    if job is None:
        raise Http404(_("No job with id %(id)s.") % {"id": object_id})
    using = chosen(request)
    back = reverse(f"{model_admin.admin_site.name}:jobs_job_change", args=[job.pk]) + query(using)
    if request.method == "POST" and request.POST.get("post") == "yes":
        done = cancels.cancel(request.user, [job.pk], via="the admin job page", using=using)
        acted = bool(done.ended or done.stopping)
        model_admin.message_user(
            request, done.summary(), messages.SUCCESS if acted else messages.WARNING
        )
        return HttpResponseRedirect(back)
    acts = eligible(job)
    context: dict[str, Any] = {
        **model_admin.admin_site.each_context(request),
        "title": _("Cancel this job?"),
        "opts": model_admin.opts,
        "job": job,
        "eligible": acts,
        "notes": effects(job.state == RunState.QUEUED, job.state == RunState.RUNNING)
        if acts
        else [],
        "asked": moment(job.cancel_requested_at, now_of(job) or database_now())
        if job.cancel_requested_at
        else "",
        "back": back,
    }
    return TemplateResponse(request, "admin/jobs/job/cancel_confirmation.html", context)


def cancel_url(model_admin: admin.ModelAdmin, job: Job) -> str:  # type: ignore[type-arg]
    """The job page's "Cancel…" link (naming the job's database when it is not the home one)."""
    url = reverse(f"{model_admin.admin_site.name}:jobs_job_cancel", args=[job.pk])
    return url + query(job._state.db or DEFAULT_DB_ALIAS)
