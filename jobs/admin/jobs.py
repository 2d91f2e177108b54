"""The jobs admin: the jobs list and detail, operator actions, and the monitor's pages.

Read-only by default: nobody edits, adds or deletes a job here, since every state change
belongs to :mod:`jobs.queue`. The deliberate actions go through :mod:`jobs.control` or the
queue once per action, for the eligible selected rows only, after a confirmation page, and
log one entry per changed row:

* replay failed jobs (``jobs.replay_job``), through the failure monitor's confirmation;
* cancel queued and running jobs (``jobs.cancel_job``), from the list or the job's page;
* run delayed jobs now ("retry now") (``jobs.change_job``);
* pause and resume job types, queues and tenants (``jobs.pause_work``), on the pauses page
  and the overview (:mod:`jobs.admin.pauses`);
* set tenant weights for fair job types (``jobs.change_tenantweight``), each change logged
  (:mod:`jobs.admin.flow`).

List actions take the newest ``ACTION_LIMIT`` eligible rows of a selection at most, as
replay-all. The failure monitor, its grouped view, replay and the overview are mounted under
this admin's URLs (``admin/jobs/job/monitor/`` …), so the default admin site is kept; the
processes page is :class:`jobs.admin.processes.ProcessAdmin`.

Over 400 lines: the jobs list, the job page and the console's URLs are one ModelAdmin; the
pages themselves live in their own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote
from django.core import checks
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from jobs import queue
from jobs.admin import (
    actions,
    flow,
    live,
    overview,
    performance,
    progress,
    schedules,
    views,
)
from jobs.admin.batches import BatchAdmin
from jobs.admin.cancels import ELIGIBLE, cancel_url, cancel_view, effects, eligible
from jobs.admin.databases import chosen
from jobs.admin.display import moment, now_of
from jobs.admin.inputs import CheckedInputs
from jobs.admin.job_display import JobDisplay, timestamp
from jobs.admin.modeladmin import RunTableAdmin as RunTableAdmin  # apps subclass it from here
from jobs.admin.pauses import PauseAdmin, pause_links
from jobs.admin.processes import ProcessAdmin
from jobs.control import cancels, pauses
from jobs.control.checks import check_run_tables
from jobs.db.clock import database_now
from jobs.models import Batch, Job, JobHistory, Pause, Process, TenantOverride, TenantWeight
from jobs.runs import RunState

# The monitor's expectations of every run table, checked wherever the admin is installed.
checks.register(check_run_tables, "jobs")


@admin.register(Job)
class JobAdmin(JobDisplay):
    list_display = (
        "id",
        "name",
        "job_id",
        "tenant",
        "queue",
        "state",
        "attempts_display",
        "last_error",
        "run_after_column",
        "created_at",
    )
    actions = ["replay_selected", "cancel_selected", "run_now_selected"]
    change_list_template = "admin/jobs/job/change_list.html"
    fieldsets = (
        JobDisplay.detail_fieldsets[0],
        JobDisplay.progress_fieldset,
        *JobDisplay.detail_fieldsets[1:],
        (
            _("Timestamps"),
            {"fields": ("created", "due", "started", "finished")},
        ),
        (
            _("Lease and heartbeat"),
            {"fields": ("claimed_by", "claim_token", "lease_expiry", "heartbeat")},
        ),
        (
            _("Replay, cancel and result"),
            {"fields": ("replayed", "replayed_by", "cancel_requested", "result_pretty")},
        ),
    )
    readonly_fields = (*JobDisplay.readonly_fields, "cancel_requested", "lease_expiry", "heartbeat")
    lease_expiry = timestamp("lease_expires_at", _("lease expires at"))
    heartbeat = timestamp("heartbeat_at", _("heartbeat at"))

    @admin.display(description=_("cancel requested"))
    def cancel_requested(self, obj: Job) -> str:
        if obj.cancel_requested_at is None:
            return "—"
        return format_html(
            gettext("by {by} at {at}"),
            by=obj.cancel_requested_by or "?",
            at=moment(obj.cancel_requested_at, now_of(obj)),
        )

    @admin.display(description=_("run after"), ordering="run_after")
    def run_after_column(self, obj: Job) -> str:
        """A job waiting for others has no due time yet: it says what it waits for."""
        if obj.waiting_on:
            return ngettext(
                "waiting for %(count)d job", "waiting for %(count)d jobs", obj.waiting_on
            ) % {"count": obj.waiting_on}
        return moment(obj.run_after, now_of(obj))

    @admin.display(description=_("progress"))
    def progress_column(self, obj: Job) -> str:
        return progress.cell(obj.progress, running=obj.state == RunState.RUNNING)

    def get_list_display(self, request: HttpRequest) -> Any:
        """The running jobs view (``?state__exact=running``) has a progress column."""
        columns = list(super().get_list_display(request))
        if request.GET.get("state__exact") == RunState.RUNNING:
            at = next((i + 1 for i, c in enumerate(columns) if c == "state"), len(columns))
            columns.insert(at, "progress_column")
        return columns

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return cancels.can_cancel(request.user)

    def has_run_now_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.change_job")

    @admin.action(permissions=["cancel"], description=_("Cancel selected jobs…"))
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        """Queued jobs end now; running ones are asked to stop (jobs.control.cancels)."""
        return actions.confirm_then_act(
            self,
            request,
            queryset.filter(ELIGIBLE),
            action="cancel_selected",
            title=_("Cancel jobs?"),
            act=self._cancel,
            notes=self._cancel_notes,
            confirm=lambda n: ngettext(
                "Yes, cancel %(count)d job", "Yes, cancel %(count)d jobs", n
            ),
        )

    @admin.action(permissions=["run_now"], description=_("Retry selected delayed jobs now…"))
    def run_now_selected(
        self, request: HttpRequest, queryset: QuerySet[Job]
    ) -> HttpResponse | None:
        return actions.confirm_then_act(
            self,
            request,
            # PostgreSQL's clock, as queue.run_now() judges it: not the web host's.
            queryset.filter(state=RunState.QUEUED, run_after__gt=Now()),
            action="run_now_selected",
            title=_("Run delayed jobs now?"),
            act=partial(
                actions.act_and_log,
                self,
                logged="Made due now via the admin jobs list (retry now)",
                call=lambda ids, by: queue.run_now(ids, using=chosen(request)),
                done=lambda n: ngettext(
                    "Made %(count)d job due now.", "Made %(count)d jobs due now.", n
                ),
            ),
        )

    def _cancel(self, request: HttpRequest, ids: list[int]) -> None:
        """The confirming POST of a cancel: jobs.control checks, changes and records."""
        done = cancels.cancel(request.user, ids, via="the admin jobs list", using=chosen(request))
        acted = len(done.ended) + len(done.stopping)
        message = done.summary()
        if (selected := len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))) > len(ids):
            message += " " + actions.not_eligible(selected - len(ids))
        self.message_user(request, message, messages.SUCCESS if acted else messages.WARNING)

    @staticmethod
    def _cancel_notes(states: list[str]) -> list[str]:
        return effects(states.count(RunState.QUEUED), states.count(RunState.RUNNING))

    def get_urls(self) -> list[URLPattern]:
        site = self.admin_site

        def wrap(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
            return site.admin_view(partial(view, site=site))

        cancel = site.admin_view(partial(cancel_view, model_admin=self))
        return [
            path("<path:object_id>/cancel/", cancel, name="jobs_job_cancel"),
            path("monitor/", wrap(views.monitor), name="jobs_monitor"),
            path("monitor/groups/", wrap(views.groups), name="jobs_monitor_groups"),
            path("monitor/replay/", wrap(views.replay_view), name="jobs_monitor_replay"),
            path("overview/", wrap(overview.overview), name="jobs_overview"),
            *performance.urls(wrap),
            *schedules.urls(wrap),
            *flow.urls(wrap),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, with *Pause…* for the job type, queue or tenant it is filtered by."""
        extra = dict(extra_context or {})
        if pauses.can_pause(request.user):
            extra["pause_links"] = pause_links(request, self.admin_site.name)
        return live.respond(request, super().changelist_view(request, extra))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The job's page, with "Cancel…" for an active job and a stopping job's request."""
        extra = dict(extra_context or {})
        job = self.get_object(request, object_id) if request.method == "GET" else None
        if request.method == "GET" and job is None:
            moved = self._history_page(request, object_id)
            if moved is not None:
                return moved
        if job is not None:
            asked = job.cancel_requested_at
            if cancels.can_cancel(request.user) and eligible(job):
                extra["cancel_url"] = cancel_url(self, job)
            if asked is not None:
                extra["cancel_requested"] = {
                    "by": job.cancel_requested_by or "?",
                    "at": moment(asked, now_of(job) or database_now()),
                }
            # A running job's page refreshes its progress in place (jobs.admin.live).
            extra["live"] = job.state == RunState.RUNNING or live.is_live(request)
        return live.respond(request, super().change_view(request, object_id, form_url, extra))

    def _history_page(self, request: HttpRequest, object_id: str) -> HttpResponse | None:
        """A redirect to the job's page in the history, if it has left for it and the user may
        read it there: most jobs leave as they end, so a page open on a running job finds it
        there at its next refresh."""
        history = self.admin_site._registry.get(JobHistory)
        if history is None or not history.has_view_permission(request):
            return None
        try:
            found = history.get_queryset(request).filter(pk=object_id).exists()
        except (ValueError, ValidationError):
            return None
        if not found:
            return None
        page = reverse(f"{self.admin_site.name}:jobs_jobhistory_change", args=[quote(object_id)])
        return redirect(page + (f"?{request.GET.urlencode()}" if request.GET else ""))


admin.site.register(Pause, PauseAdmin)
admin.site.register(Process, ProcessAdmin)
admin.site.register(TenantWeight, flow.TenantWeightAdmin)
admin.site.register(Batch, BatchAdmin)


@admin.register(JobHistory)
class JobHistoryAdmin(JobDisplay):
    """Finished jobs the archive moved out of the jobs table, newest first; replay only.

    Readable by whoever may read the jobs list; replay needs ``jobs.replay_job``, as there.
    """

    list_display = (
        "id",
        "name",
        "job_id",
        "tenant",
        "queue",
        "state",
        "attempts_display",
        "last_error",
        "finished_at",
    )
    # The history's index is by finished_at in every partition; ids are not ordered there.
    ordering = ("-finished_at",)
    fieldsets = (
        JobDisplay.detail_fieldsets[0],
        JobDisplay.progress_fieldset,
        *JobDisplay.detail_fieldsets[1:],
        (
            _("Timestamps"),
            {"fields": ("created", "due", "started", "finished", "archived")},
        ),
        (
            _("Replay and result"),
            {"fields": ("claimed_by", "replayed", "replayed_by", "result_pretty")},
        ),
    )
    readonly_fields = (*JobDisplay.readonly_fields, "archived")
    archived = timestamp("archived_at", _("archived at"))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.run_table.can_view(request.user)


@admin.register(TenantOverride)
class TenantOverrideAdmin(CheckedInputs, admin.ModelAdmin):  # type: ignore[type-arg]  # generic in stubs
    """Overrides are configuration: add and delete them; a row's tenant and component stay."""

    list_display = ("tenant", "component", "note", "created_at")
    list_filter = ("component",)
    search_fields = ("tenant",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Moving an existing override would silently move a tenant between workers.
        return ("tenant", "component", "created_at") if obj else ("created_at",)
