"""The processes page: every ``runworker`` and ``runscheduler`` process, live or gone.

Read-only: rows are written by the processes themselves (:mod:`jobs.queue.processes`), so
nobody adds, changes or deletes one here; ``jobs.view_process`` lets a user see the page, and
the jobs a process holds are listed for users who may also view jobs.
States and ages are judged by PostgreSQL's clock, which wrote every beat::

    ready     beating, claiming (a scheduler: standing by or leading)
    draining  beating, stopping: claims nothing, finishing what it holds
    gone      no beat before expires_at: killed, stalled or cut off; pruned later
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from jobs.admin import live, progress
from jobs.admin.display import duration, moment, now_of, with_now
from jobs.admin.inputs import CheckedInputs
from jobs.admin.modeladmin import ConsoleColumns
from jobs.control.tables import RunTable
from jobs.models import Job, Process
from jobs.queue import processes

_STATE_LABELS = {"ready": _("ready"), "draining": _("draining"), "gone": _("gone")}


class StateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return list(_STATE_LABELS.items())

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "gone":
            return queryset.filter(gone=True)
        if value in ("ready", "draining"):
            return queryset.filter(gone=False, draining=value == "draining")
        return queryset


# django-stubs declare ModelAdmin generic; Django's takes no type arguments at run time.
class ProcessAdmin(CheckedInputs, ConsoleColumns, admin.ModelAdmin):  # type: ignore[type-arg]
    """The processes list and, on each process's page, the jobs it holds now."""

    clipped = frozenset({"identity", "version"})

    # What an operator scans for first, first; host and pid are in the identity (host:pid:nonce)
    # and on each process's page, so the list stays readable at 1280 px beside the filters.
    list_display = (
        "identity",
        "component",
        "state_display",
        "held",
        "free_display",
        "concurrency",
        "leader",
        "last_seen_display",
        "started_display",
        "version",
        "scope",
    )
    list_filter = (StateFilter, "component", "leader", "host")
    search_fields = ("identity", "host")
    ordering = ("-component", "host", "started_at")
    fieldsets = (
        (None, {"fields": ("identity", "component", "host", "pid", "version", "scope")}),
        (
            _("Now"),
            {
                "fields": (
                    "state_display",
                    "leader",
                    "concurrency",
                    "held",
                    "free_display",
                    "held_jobs",
                )
            },
        ),
        (
            _("Timestamps"),
            {"fields": ("started_display", "last_seen_display", "expires_display")},
        ),
    )
    readonly_fields = (
        "identity",
        "component",
        "host",
        "pid",
        "version",
        "scope",
        "concurrency",
        "held",
        "leader",
        "free_display",
        "state_display",
        "held_jobs",
        "started_display",
        "last_seen_display",
        "expires_display",
    )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, refreshed in place while open (:mod:`jobs.admin.live`)."""
        return live.respond(request, super().changelist_view(request, extra_context))

    def get_queryset(self, request: HttpRequest) -> QuerySet[Process]:
        return with_now(processes.listing(using=self.model.objects.db))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """The jobs a process holds are jobs: listed only for users who may view jobs."""
        fieldsets = super().get_fieldsets(request, obj)
        if RunTable(Job).can_view(request.user):
            return fieldsets
        return [
            (name, {**options, "fields": [f for f in options["fields"] if f != "held_jobs"]})
            for name, options in fieldsets
        ]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("state"), ordering="expires_at")
    def state_display(self, obj: Process) -> str:
        state = "gone" if getattr(obj, "gone", False) else "draining" if obj.draining else "ready"
        return format_html('<span class="jobs-process-{}">{}</span>', state, _STATE_LABELS[state])

    @admin.display(description=_("free slots"))
    def free_display(self, obj: Process) -> str:
        if obj.concurrency is None:
            return "—"
        if getattr(obj, "gone", False) or obj.draining:
            return "0"
        return str(max(0, obj.concurrency - obj.held))

    @admin.display(description=_("started"), ordering="started_at")
    def started_display(self, obj: Process) -> str:
        return moment(obj.started_at, now_of(obj))

    @admin.display(description=_("last seen"), ordering="last_seen_at")
    def last_seen_display(self, obj: Process) -> str:
        return moment(obj.last_seen_at, now_of(obj))

    @admin.display(description=_("gone after"))
    def expires_display(self, obj: Process) -> str:
        return moment(obj.expires_at, now_of(obj))

    @admin.display(description=_("jobs held"))
    def held_jobs(self, obj: Process) -> str:
        """The running jobs whose claim names this process, oldest first, read now."""
        found = processes.status(obj.identity, using=self.model.objects.db)
        jobs = found[0].jobs if found else ()
        if not jobs:
            return "—"
        rows = format_html_join(
            "",
            '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>'
            "<td>{}</td></tr>",
            (
                (
                    reverse(f"{self.admin_site.name}:jobs_job_change", args=[job.id]),
                    job.job_id,
                    job.name,
                    job.tenant,
                    job.attempts,
                    duration(job.elapsed) if job.elapsed is not None else "—",
                    progress.cell(job.progress, running=True),
                )
                for job in jobs
            ),
        )
        return format_html(
            '<table class="jobs-held"><thead><tr><th>{}</th><th>{}</th><th>{}</th><th>{}</th>'
            "<th>{}</th><th>{}</th></tr></thead><tbody>{}</tbody></table>",
            _("job id"),
            _("job type"),
            _("tenant"),
            _("attempt"),
            _("running for"),
            _("progress"),
            rows,
        )
