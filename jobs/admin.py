"""The jobs admin: the jobs list and detail, operator actions, and the monitor's pages.

Read-only by default: nobody edits, adds or deletes a job here, since every state change
belongs to :mod:`jobs.queue`. The deliberate actions call the queue once per action, for the
eligible selected rows only, after a confirmation page, and log one entry per changed row:

* replay failed jobs (``jobs.replay_job``), through the failure monitor's confirmation;
* cancel queued jobs and run delayed ones now ("retry now") (``jobs.change_job``), the
  newest ``ACTION_LIMIT`` eligible rows of a selection at most, as replay-all.

The failure monitor, its grouped view, replay and the overview are mounted under this
admin's URLs (``admin/jobs/job/monitor/`` …), so the default admin site is kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.core import checks
from django.db import transaction
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.functional import Promise
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from jobs import queue
from jobs.control.checks import check_run_tables
from jobs.control.failures import MAX_ROWS
from jobs.control.replays import REPLAY_ALL_LIMIT
from jobs.models import Job, JobHistory, TenantOverride
from jobs.monitor import overview, views
from jobs.monitor.modeladmin import InputFilter, RunTableAdmin
from jobs.registry import get_registry
from jobs.runs import RunState

# Rows one cancel or retry-now may change, over "select all" too: replay-all's bound.
ACTION_LIMIT = REPLAY_ALL_LIMIT

# The monitor's expectations of every run table, checked wherever the admin is installed.
checks.register(check_run_tables, "jobs")


class JobTypeFilter(admin.SimpleListFilter):
    """Job types from the registry: choices without a ``SELECT DISTINCT`` over the table."""

    title = _("job type")
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = set(get_registry().names())
        if value := self.value():
            names.add(value)
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(name=self.value()) if self.value() else queryset


class TenantFilter(InputFilter):
    title = _("tenant")
    parameter_name = field_name = "tenant"


class QueueFilter(InputFilter):
    title = _("queue")
    parameter_name = field_name = "queue"


class JobDisplay(RunTableAdmin):
    """What the jobs list and the finished-jobs history share: filters, renderings, detail."""

    list_display_links = ("id", "job_id")
    list_filter = ("state", JobTypeFilter, TenantFilter, QueueFilter, "last_error")
    readonly_fields = ("payload_pretty", "error_detail_pre", "result_pretty", "attempts_display")
    #: The detail page's first sections; each admin adds its own timestamps and the rest.
    detail_fieldsets: tuple[Any, ...] = (
        (None, {"fields": ("job_id", "name", "tenant", "queue", "priority", "state")}),
        (_("Payload"), {"fields": ("payload_pretty",)}),
        (
            _("Attempts and errors"),
            {"fields": ("attempts_display", "last_error", "error_detail_pre")},
        ),
    )

    @admin.display(description=_("attempts"))
    def attempts_display(self, obj: Job | JobHistory) -> str:
        return f"{obj.attempts} / {obj.max_attempts}"

    @admin.display(description=_("payload"))
    def payload_pretty(self, obj: Job | JobHistory) -> str:
        return _pre(json.dumps(obj.payload, indent=2, sort_keys=True, ensure_ascii=False))

    @admin.display(description=_("result"))
    def result_pretty(self, obj: Job | JobHistory) -> str:
        if obj.result is None:
            return "—"
        return _pre(json.dumps(obj.result, indent=2, sort_keys=True, ensure_ascii=False))

    @admin.display(description=_("error detail"))
    def error_detail_pre(self, obj: Job | JobHistory) -> str:
        return _pre(obj.error_detail) if obj.error_detail else "—"


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
        "run_after",
        "created_at",
    )
    actions = ["replay_selected", "cancel_selected", "run_now_selected"]
    change_list_template = "admin/jobs/job/change_list.html"
    fieldsets = (
        *JobDisplay.detail_fieldsets,
        (
            _("Timestamps"),
            {"fields": ("created_at", "run_after", "started_at", "finished_at")},
        ),
        (
            _("Lease and heartbeat"),
            {"fields": ("claimed_by", "claim_token", "lease_expires_at", "heartbeat_at")},
        ),
        (_("Replay and result"), {"fields": ("replayed_at", "replayed_by", "result_pretty")}),
    )

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.change_job")

    @admin.action(permissions=["cancel"], description=_("Cancel selected queued jobs…"))
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        return self._queue_action(
            request,
            queryset.filter(state=RunState.QUEUED),
            action="cancel_selected",
            logged="Cancelled via the admin jobs list",
            title=_("Cancel queued jobs?"),
            call=lambda ids, by: queue.cancel(ids, by=by),
            done=lambda n: ngettext("Cancelled %(count)d job.", "Cancelled %(count)d jobs.", n),
        )

    @admin.action(permissions=["cancel"], description=_("Retry selected delayed jobs now…"))
    def run_now_selected(
        self, request: HttpRequest, queryset: QuerySet[Job]
    ) -> HttpResponse | None:
        return self._queue_action(
            request,
            # PostgreSQL's clock, as queue.run_now() judges it: not the web host's.
            queryset.filter(state=RunState.QUEUED, run_after__gt=Now()),
            action="run_now_selected",
            logged="Made due now via the admin jobs list (retry now)",
            title=_("Run delayed jobs now?"),
            call=lambda ids, by: queue.run_now(ids),
            done=lambda n: ngettext(
                "Made %(count)d job due now.", "Made %(count)d jobs due now.", n
            ),
        )

    def _queue_action(
        self,
        request: HttpRequest,
        eligible: QuerySet[Job],
        *,
        action: str,
        logged: str,
        title: str | Promise,
        call: Callable[[list[int], str], list[int]],
        done: Callable[[int], str],
    ) -> HttpResponse | None:
        """Confirm, then one queue call for the rows the page showed; log and report them.

        The page takes the newest ``ACTION_LIMIT`` eligible rows (over "select all" too) and
        says so; its confirming POST names exactly those rows, so nothing changes that the
        operator was not shown. A "yes" over a whole filter (``select_across``) is asked again.
        """
        taken = list(eligible.order_by("-pk").values_list("pk", flat=True)[:ACTION_LIMIT])
        across = request.POST.get("select_across") == "1"
        if request.POST.get("post") == "yes" and not across:
            self._act(request, taken, logged=logged, call=call, done=done)
            return None
        matching = len(taken)
        if matching >= ACTION_LIMIT:  # there may be more: count them, up to the list's cap
            matching = eligible.order_by().values("pk")[:MAX_ROWS].count()
        selected = len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "jobs": eligible.order_by("-pk")[: min(len(taken), 100)],  # the rows it changes
            "ids": taken,
            "count": matching,
            "capped": matching >= MAX_ROWS,
            "limit": ACTION_LIMIT,
            "skipped": 0 if across else max(0, selected - matching),
            "action": action,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/jobs/job/action_confirmation.html", context)

    def _act(
        self,
        request: HttpRequest,
        ids: list[int],
        *,
        logged: str,
        call: Callable[[list[int], str], list[int]],
        done: Callable[[int], str],
    ) -> None:
        """The confirming POST: one queue call, one log entry per changed row, a message.

        The change and its record commit together: no change without who made it.
        """
        with transaction.atomic():
            changed = call(ids, request.user.get_username()) if ids else []
            if changed:
                assert request.user.pk is not None  # the admin lets in only logged-in staff
                LogEntry.objects.log_actions(
                    request.user.pk,
                    Job.objects.filter(pk__in=changed).order_by("pk"),
                    CHANGE,
                    change_message=logged,
                )
        selected = len(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
        message = done(len(changed)) % {"count": len(changed)}
        if selected > len(changed):
            message += " " + ngettext(
                "%(count)d selected job was not eligible.",
                "%(count)d selected jobs were not eligible.",
                selected - len(changed),
            ) % {"count": selected - len(changed)}
        self.message_user(request, message, messages.SUCCESS if changed else messages.WARNING)

    def get_urls(self) -> list[URLPattern]:
        site = self.admin_site

        def wrap(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
            return site.admin_view(partial(view, site=site))

        return [
            path("monitor/", wrap(views.monitor), name="jobs_monitor"),
            path("monitor/groups/", wrap(views.groups), name="jobs_monitor_groups"),
            path("monitor/replay/", wrap(views.replay_view), name="jobs_monitor_replay"),
            path("overview/", wrap(overview.overview), name="jobs_overview"),
            *super().get_urls(),
        ]


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
        *JobDisplay.detail_fieldsets,
        (
            _("Timestamps"),
            {"fields": ("created_at", "run_after", "started_at", "finished_at", "archived_at")},
        ),
        (
            _("Replay and result"),
            {"fields": ("claimed_by", "replayed_at", "replayed_by", "result_pretty")},
        ),
    )

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.run_table.can_view(request.user)


@admin.register(TenantOverride)
class TenantOverrideAdmin(admin.ModelAdmin):  # type: ignore[type-arg]  # generic in the stubs only
    """Overrides are configuration: add and delete them; a row's tenant and component stay."""

    list_display = ("tenant", "component", "note", "created_at")
    list_filter = ("component",)
    search_fields = ("tenant",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        # Moving an existing override would silently move a tenant between workers.
        return ("tenant", "component", "created_at") if obj else ("created_at",)


def _pre(text: str) -> str:
    return format_html('<pre class="jobs-pre">{}</pre>', text)
