"""The admin's batches: each batch's counts, its members and its successor (read-only).

Batches change only through their members' state changes (the settle trigger) and the code
that opened them, so the admin shows them and links onwards; it edits nothing.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext_lazy as _

from jobs.admin.inputs import CheckedInputs
from jobs.models import Batch


class BatchStatusFilter(admin.SimpleListFilter):
    title = _("status")
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("open", _("open (its creator may add members)")),
            ("running", _("sealed, members still to finish")),
            ("finished", _("finished")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Batch]) -> QuerySet[Batch]:
        value = self.value()
        if value == "open":
            return queryset.filter(sealed_at__isnull=True, fired_at__isnull=True)
        if value == "running":
            return queryset.filter(sealed_at__isnull=False, fired_at__isnull=True)
        if value == "finished":
            return queryset.filter(fired_at__isnull=False)
        return queryset


class BatchAdmin(CheckedInputs, admin.ModelAdmin):  # type: ignore[type-arg]  # generic in stubs only
    list_display = (
        "id",
        "description",
        "status",
        "finished_of_total",
        "outcomes",
        "successor_link",
    )
    date_hierarchy = "created_at"
    list_display_links = ("id", "description")
    list_filter = (BatchStatusFilter, "tenant")
    search_fields = ("description", "=id")
    ordering = ("-id",)
    readonly_fields = (
        "id",
        "description",
        "tenant",
        "created_at",
        "created_by",
        "status",
        "sealed_at",
        "finished_of_total",
        "succeeded",
        "failed",
        "cancelled",
        "members_link",
        "fired_at",
        "successor_link",
        "successor_template",
    )
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Whoever may view jobs may view the batches they form.
        return super().has_view_permission(request, obj) or request.user.has_perm("jobs.view_job")

    @admin.display(description=_("status"))
    def status(self, obj: Batch) -> str:
        if obj.fired_at is not None:
            return str(_("finished"))
        if obj.sealed_at is None:
            return str(_("open"))
        return str(_("running"))

    @admin.display(description=_("finished"))
    def finished_of_total(self, obj: Batch) -> str:
        return f"{obj.finished:,} / {obj.total:,}"

    @admin.display(description=_("outcomes"))
    def outcomes(self, obj: Batch) -> str:
        parts = [
            f"{count:,} {label}"
            for count, label in (
                (obj.succeeded, _("succeeded")),
                (obj.failed, _("failed")),
                (obj.cancelled, _("cancelled")),
            )
            if count
        ]
        return ", ".join(parts) or "—"

    @admin.display(description=_("members"))
    def members_link(self, obj: Batch) -> SafeString:
        active = reverse("admin:jobs_job_changelist") + f"?batch={obj.pk}"
        archived = reverse("admin:jobs_jobhistory_changelist") + f"?batch_id={obj.pk}"
        return format_html(
            '<a href="{}">{}</a> · <a href="{}">{}</a>',
            active,
            _("in the jobs table"),
            archived,
            _("finished and archived"),
        )

    @admin.display(description=_("successor"))
    def successor_link(self, obj: Batch) -> SafeString | str:
        if obj.successor_pk is None:
            return "—" if obj.successor is None else str(_("not yet enqueued"))
        url = reverse("admin:jobs_job_change", args=[obj.successor_pk])
        return format_html('<a href="{}">{}</a>', url, obj.successor_pk)

    @admin.display(description=_("successor to enqueue"))
    def successor_template(self, obj: Batch) -> str:
        if not obj.successor:
            return "—"
        return f"{obj.successor.get('name')} (queue {obj.successor.get('queue')})"


def in_workflow(obj: Any) -> bool:
    """Whether the job has a place in a batch or a dependency (one cheap check, no rendering)."""
    from jobs.models import Dependency

    return bool(
        getattr(obj, "batch_id", None) is not None
        or Batch.objects.filter(successor_pk=obj.pk).exists()
        or Dependency.objects.filter(Q(job=obj.pk) | Q(upstream=obj.pk)).exists()
    )


def workflow(obj: Any) -> SafeString | str:
    """A job's place in batches and dependencies, for its page: links onwards, or ``""``."""
    from jobs.models import Dependency, Job, JobHistory

    lines = []
    batch_id = getattr(obj, "batch_id", None)
    if batch_id is not None:
        batch = Batch.objects.filter(pk=batch_id).first()
        url = reverse("admin:jobs_batch_change", args=[batch_id])
        lines.append(
            format_html(
                '{} <a href="{}">#{}</a>{}',
                _("member of batch"),
                url,
                batch_id,
                f" ({batch.description}, {batch.finished:,} / {batch.total:,} finished)"
                if batch
                else f" ({_('deleted by retention')})",
            )
        )
    for batch in Batch.objects.filter(successor_pk=obj.pk):
        url = reverse("admin:jobs_batch_change", args=[batch.pk])
        lines.append(format_html('{} <a href="{}">#{}</a>', _("successor of batch"), url, batch.pk))
    if isinstance(obj, Job):
        upstream = list(Dependency.objects.filter(job=obj.pk).values_list("upstream", flat=True))
        if upstream:
            states = dict(Job.objects.filter(pk__in=upstream).values_list("pk", "state"))
            states.update(
                JobHistory.objects.filter(pk__in=set(upstream) - set(states)).values_list(
                    "pk", "state"
                )
            )
            links = format_html_join(
                ", ",
                '<a href="{}">#{}</a> ({})',
                (
                    (reverse("admin:jobs_job_change", args=[up]), up, states.get(up, _("gone")))
                    for up in upstream
                ),
            )
            still = (
                format_html(" — {} {}", _("still waiting for"), obj.waiting_on)
                if obj.waiting_on
                else ""
            )
            lines.append(format_html("{} {}{}", _("waits for"), links, still))
        # By its edges, not the depended_on mark, which an enqueue sets as it commits.
        count = Dependency.objects.filter(upstream=obj.pk).count()
        if count:
            lines.append(format_html("{} {}", count, _("jobs wait for this one")))
    return format_html_join(mark_safe("<br>"), "{}", ((line,) for line in lines))
