"""The schedules page: every schedule, how its last slot went, what comes next; run, pause, resume.

Read from :func:`jobs.scheduler.status` (one query), the pauses table, the latest recorded
slots and the jobs those slots enqueued (in ``jobs_job``, else in the history; a job found in
neither was pruned, and the page says so). "Now" is PostgreSQL's, read once per page. Every
change goes through :mod:`jobs.control.schedules`; each control asks first and acts only on the
confirming POST (CSRF-protected, as every admin POST)::

    Run now…  GET  <name>/run/[?next=…]      confirmation, carrying a fresh token
              POST <name>/run/ with post=yes  one extra job (no slot), logged; back to ``next``
    Pause…    GET  <name>/pause/              confirmation with a reason
              POST <name>/pause/ with post=yes
    Resume…   GET  <name>/resume/             confirmation
              POST <name>/resume/ with post=yes

Viewing needs ``jobs.view_scheduleslot`` or the view (or change) permission on jobs; *Run now*
needs ``jobs.run_schedule``, pause and resume ``jobs.pause_work``, each besides viewing, since
each confirmation shows the schedule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.admin import AdminSite
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _

from jobs import queue
from jobs.catalogue.schedules import Schedule
from jobs.catalogue.timing import Misfire
from jobs.control import schedules as control
from jobs.control.inputs import validate_text
from jobs.control.tables import RunTable
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory, PauseKind, SlotKind
from jobs.scheduler.reporting import ScheduleStatus, recent_slots, status

VIA = "the admin"
RECENT_LIMIT = 50

View = Callable[..., HttpResponse]


def urls(wrap: Callable[[View], View]) -> list[URLPattern]:
    """The page's URLs, mounted under the jobs admin."""
    return [
        path("schedules/", wrap(schedules_page), name="jobs_schedules"),
        path("schedules/<str:name>/run/", wrap(run_view), name="jobs_schedule_run"),
        path("schedules/<str:name>/pause/", wrap(pause_view), name="jobs_schedule_pause"),
        path("schedules/<str:name>/resume/", wrap(resume_view), name="jobs_schedule_resume"),
    ]


def schedules_page(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Every configured schedule and its latest slots, for those who may view schedule slots."""
    if not control.can_view(request.user):
        raise PermissionDenied(_("You may not view schedules."))
    now = database_now()
    context: dict[str, Any] = {
        **site.each_context(request),
        "title": _("Schedules"),
        "now": now,
        "may_run": control.can_run(request.user),
        "may_pause": control.can_pause(request.user),
        "here": request.get_full_path(),
    }
    try:
        statuses = status(now=now)
    except ImproperlyConfigured as exc:
        context["problem"] = str(exc)
        return TemplateResponse(request, "admin/jobs/schedules/page.html", context)
    names = [item.name for item in statuses]
    selected = request.GET.get("schedule") or ""
    if selected not in names:
        selected = ""
    recent = recent_slots([selected] if selected else names, limit=RECENT_LIMIT)
    jobs = Outcomes(request.user, site.name)
    jobs.load([item.last_job_pk for item in statuses] + [row.job_pk for row in recent])
    pauses = {p.value: p for p in queue.paused() if p.kind == PauseKind.SCHEDULE}
    context.update(
        schedules=[
            {
                "status": item,
                "misfire": Misfire(item.misfire).label,
                "pause": pauses.get(item.name),
                "outcome": jobs.of(item.last_job_pk, item.last_job_id),
                "skipped_since": _skipped_since(item),
            }
            for item in statuses
        ],
        slots=[
            {
                "row": row,
                "kind": SlotKind(row.kind).label,
                "outcome": jobs.of(row.job_pk, row.job_id),
                "stands_for": row.missed_from is not None and row.missed_from != row.slot,
            }
            for row in recent
        ],
        selected=selected,
        recent_limit=RECENT_LIMIT,
    )
    return TemplateResponse(request, "admin/jobs/schedules/page.html", context)


def _skipped_since(item: ScheduleStatus) -> datetime | None:
    """The latest skipped slot, when it came after the latest fired one."""
    skipped, fired = item.last_skipped_slot, item.last_fired_slot
    if skipped is not None and (fired is None or skipped > fired):
        return skipped
    return None


class Outcomes:
    """What became of the jobs slots enqueued: found in ``jobs_job``, the history, or neither."""

    def __init__(self, user: Any, site_name: str) -> None:
        self.site_name = site_name
        self.links = {
            "job": RunTable(Job).can_view(user),
            "jobhistory": RunTable(JobHistory).can_view(user),
        }
        self.found: dict[int, tuple[str, Any]] = {}

    def load(self, pks: Iterable[int | None]) -> None:
        """Two queries at most: the jobs table, then the history for the rest."""
        wanted = {pk for pk in pks if pk is not None}
        fields = ("id", "job_id", "state", "last_error", "finished_at")
        for model, where in ((Job, "job"), (JobHistory, "jobhistory")):
            missing = wanted - set(self.found)
            if missing:
                for job in model.objects.filter(pk__in=missing).only(*fields):
                    self.found[job.pk] = (where, job)

    def of(self, pk: int | None, job_id: str) -> dict[str, Any] | None:
        """The job's state, error and admin link; ``pruned`` when it is gone. None: no job."""
        if not job_id:
            return None
        where, job = self.found.get(pk, ("", None)) if pk is not None else ("", None)
        if job is None:
            return {"state": "pruned", "job_id": job_id}
        url = None
        if self.links[where]:
            url = reverse(f"{self.site_name}:jobs_{where}_change", args=[job.pk])
        return {
            "state": job.state,
            "job_id": job_id,
            "pk": job.pk,
            "error": job.last_error,
            "finished_at": job.finished_at,
            "url": url,
            "archived": where == "jobhistory",
        }


def run_view(request: HttpRequest, name: str, *, site: AdminSite) -> HttpResponse:
    """Run now…: the confirmation (GET), then the confirming POST enqueues one extra job."""
    if not control.can_run(request.user):
        raise PermissionDenied(_("You may not run schedules now."))
    _require_view(request)
    schedule = _configured(name)
    back = _back(request, site)
    if request.method == "POST" and request.POST.get("post") == "yes":
        try:
            done = control.run_now(request.user, name, token=request.POST.get("token", ""), via=VIA)
        except ValueError as exc:
            messages.error(request, str(exc))
            return HttpResponseRedirect(back)
        if done.created:
            messages.success(
                request,
                _(
                    "Enqueued one extra job of schedule %(name)s: %(job_id)s (job %(pk)s). "
                    "Its slots are unchanged."
                )
                % {"name": name, "job_id": done.job_id, "pk": done.job},
            )
        else:
            messages.warning(
                request,
                _("That run was enqueued already (job %(pk)s): nothing more was enqueued.")
                % {"pk": done.job},
            )
        return HttpResponseRedirect(back)
    paused = {(p.kind, p.value) for p in queue.paused()}
    context = {
        "schedule": schedule,
        "payload": json.dumps(schedule.payload.to_json(), indent=2, sort_keys=True),
        "token": control.new_token(),
        "schedule_paused": (PauseKind.SCHEDULE, name) in paused,
        "type_paused": (PauseKind.JOB_TYPE, schedule.job) in paused,
    }
    title = _("Run schedule %(name)s now?") % {"name": name}
    return _render(request, site, "run_confirmation.html", title, back=back, **context)


class ReasonForm(forms.Form):
    """Why a schedule is paused: shown on the schedules page and kept in the admin log."""

    reason = forms.CharField(max_length=200, required=False, validators=[validate_text])


def pause_view(request: HttpRequest, name: str, *, site: AdminSite) -> HttpResponse:
    """Pause…: the confirmation with a reason (GET), then the confirming POST pauses; a reason
    that is not valid (too long, or text the database cannot hold) shows the page again."""
    if not control.can_pause(request.user):
        raise PermissionDenied(_("You may not pause schedules."))
    _require_view(request)
    schedule = _configured(name)
    back = _back(request, site)
    form = ReasonForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and request.POST.get("post") == "yes" and form.is_valid():
        reason = form.cleaned_data["reason"]
        if control.pause(request.user, name, reason=reason, via=VIA):
            messages.success(
                request,
                _("Paused schedule %(name)s: it fires no slot from the scheduler's next tick.")
                % {"name": name},
            )
        else:
            messages.warning(
                request,
                _("Schedule %(name)s was paused already: nothing changed.") % {"name": name},
            )
        return HttpResponseRedirect(back)
    existing = next(
        (p for p in queue.paused() if (p.kind, p.value) == (PauseKind.SCHEDULE, name)), None
    )
    title = _("Pause schedule %(name)s?") % {"name": name}
    context = {"schedule": schedule, "existing": existing, "form": form}
    return _render(request, site, "pause_confirmation.html", title, back=back, **context)


def resume_view(request: HttpRequest, name: str, *, site: AdminSite) -> HttpResponse:
    """Resume…: the confirmation (GET), then the confirming POST resumes."""
    if not control.can_pause(request.user):
        raise PermissionDenied(_("You may not resume schedules."))
    _require_view(request)
    schedule = _configured(name)
    back = _back(request, site)
    if request.method == "POST" and request.POST.get("post") == "yes":
        if control.resume(request.user, name, via=VIA):
            messages.success(
                request,
                _(
                    "Resumed schedule %(name)s. Slots that came due while it was paused are "
                    "recorded as skipped; its next slot fires on time."
                )
                % {"name": name},
            )
        else:
            messages.warning(
                request, _("Schedule %(name)s was not paused: nothing changed.") % {"name": name}
            )
        return HttpResponseRedirect(back)
    existing = next(
        (p for p in queue.paused() if (p.kind, p.value) == (PauseKind.SCHEDULE, name)), None
    )
    title = _("Resume schedule %(name)s?") % {"name": name}
    context = {"schedule": schedule, "existing": existing, "now": database_now()}
    return _render(request, site, "resume_confirmation.html", title, back=back, **context)


def _require_view(request: HttpRequest) -> None:
    """Refuse a confirmation to a user who may not view schedules: it shows the schedule
    (job type, tenant, timing, and for *Run now* the payload), whatever it then does."""
    if not control.can_view(request.user):
        raise PermissionDenied(_("You may not view schedules."))


def _configured(name: str) -> Schedule:
    try:
        return control.find(name)
    except (ValueError, ImproperlyConfigured):
        raise Http404(_("No schedule named %(name)s is configured.") % {"name": name}) from None


def _back(request: HttpRequest, site: AdminSite) -> str:
    """Where to go afterwards: a ``next`` on this site, else the schedules page."""
    candidate = request.POST.get("next") or request.GET.get("next") or ""
    if candidate and url_has_allowed_host_and_scheme(
        candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return candidate
    return reverse(f"{site.name}:jobs_schedules")


def _render(
    request: HttpRequest, site: AdminSite, template: str, title: str, **context: Any
) -> HttpResponse:
    context = {**site.each_context(request), "title": title, **context}
    return TemplateResponse(request, f"admin/jobs/schedules/{template}", context)
