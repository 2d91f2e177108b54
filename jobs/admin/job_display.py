"""How the jobs admin shows a job: the list's filters and the detail page, for the jobs table
and the finished-jobs history alike (:class:`JobDisplay`, which both admins of
:mod:`jobs.admin.jobs` extend)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from django.contrib import admin
from django.db import DEFAULT_DB_ALIAS
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from jobs.admin import attempts, batches, progress
from jobs.admin.databases import DatabaseFilter, DatabaseRunTableAdmin
from jobs.admin.display import moment, now_of
from jobs.admin.modeladmin import InputFilter
from jobs.catalogue.registry import get_registry
from jobs.models import Job, JobHistory

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


def timestamp(field: str, label: StrOrPromise) -> Callable[[Any, Any], str]:
    """A read-only detail field showing ``field`` to the second, with zone and age."""

    def show(model_admin: Any, obj: Any) -> str:
        return moment(getattr(obj, field), now_of(obj))

    return admin.display(description=label)(show)


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


class JobDisplay(DatabaseRunTableAdmin):
    """What the jobs list and the finished-jobs history share: filters, renderings, detail.

    Both read the alias the request chooses (:mod:`jobs.admin.databases`).
    """

    list_display_links = ("id", "job_id")
    list_filter = (DatabaseFilter, "state", JobTypeFilter, TenantFilter, QueueFilter, "last_error")
    readonly_fields: ClassVar[list[str] | tuple[str, ...]] = (
        "payload_pretty",
        "error_detail_pre",
        "result_pretty",
        "attempts_display",
        "attempt_timeline",
        "created",
        "due",
        "started",
        "finished",
        "replayed",
        "progress_display",
        "workflow_display",
    )
    change_form_template = "admin/jobs/job/change_form.html"
    #: The detail page's first sections; each admin adds its own timestamps and the rest.
    detail_fieldsets: tuple[Any, ...] = (
        (None, {"fields": ("job_id", "name", "tenant", "queue", "priority", "state")}),
        (_("Payload"), {"fields": ("payload_pretty",)}),
        (
            _("Attempts and errors"),
            {"fields": ("attempts_display", "last_error", "error_detail_pre")},
        ),
        (_("Attempt timeline"), {"fields": ("attempt_timeline",), "classes": ("jobs-timeline",)}),
    )
    #: The handler's last progress report (jobs.core.progress), after the first section.
    progress_fieldset: tuple[Any, ...] = (_("Progress"), {"fields": ("progress_display",)})

    created = timestamp("created_at", _("created at"))

    @admin.display(description=_("run after"))
    def due(self, obj: Job | JobHistory) -> str:
        """No time while the job waits for others, and none kept by one that ended waiting."""
        if obj.run_after is None:
            if getattr(obj, "waiting_on", 0):
                return gettext("when the jobs it waits for have succeeded")
            return gettext("never: it ended while it waited for other jobs")
        return moment(obj.run_after, now_of(obj))

    started = timestamp("started_at", _("started at"))
    finished = timestamp("finished_at", _("finished at"))
    replayed = timestamp("replayed_at", _("replayed at"))

    @admin.display(description=_("batch and dependencies"))
    def workflow_display(self, obj: Job | JobHistory) -> str:
        return batches.workflow(obj)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """A job in a batch or in a dependency gets a section saying so, after the first."""
        fieldsets = list(super().get_fieldsets(request, obj))
        # Batches and dependencies are read from the default alias (jobs.admin.databases).
        home = (obj._state.db or DEFAULT_DB_ALIAS) == DEFAULT_DB_ALIAS if obj else False
        if home and batches.in_workflow(obj):
            fieldsets.insert(1, (_("Workflow"), {"fields": ("workflow_display",)}))
        return fieldsets

    @admin.display(description=_("attempt timeline"))
    def attempt_timeline(self, obj: Job | JobHistory) -> str:
        return attempts.render(obj)

    @admin.display(description=_("progress"))
    def progress_display(self, obj: Job | JobHistory) -> str:
        return progress.detail(obj, now_of(obj))

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


def _pre(text: str) -> str:
    return format_html('<pre class="jobs-pre">{}</pre>', text)
