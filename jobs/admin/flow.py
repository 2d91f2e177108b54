"""The flow-control page: each job type's fleet-wide limits, and whether they hold work back now.

A row per job type with any flow control (a global or per-tenant concurrency limit, a rate
limit, fairness between tenants, or a throttle in force): how many of its jobs run now against
its global limit, its rate limit and the tokens left in its bucket, its due jobs, whether a
limit is holding due jobs back right now (*limiting*) and why, and a throttle a handler asked
for (until when, and its reason). For types read tenant by tenant (fair, or with a tenant
limit) a table of the tenants with the most due work (at most :data:`TENANT_ROWS`): each
one's due jobs, running jobs, weight and share of the type's starts.

Every read goes through the queue (:mod:`jobs.queue.flow`, :func:`jobs.queue.backlog`), with a
fixed number of statements: the backlog, the gates' state, the throttles, one tenant read per
tenant-ordered type (a registered type: the number is fixed by code, not by data), and the
weights of the tenants shown. "Now" is PostgreSQL's, read once per page.

Tenant weights are edited on their own admin list (:class:`TenantWeightAdmin`), by users with
``jobs.change_tenantweight``; each change is recorded as a ``LogEntry``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.formats import number_format
from django.utils.http import urlencode
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from jobs import queue
from jobs.admin import live
from jobs.admin.inputs import CheckedInputs
from jobs.catalogue.policy import Policy, Rate
from jobs.catalogue.registry import Registry, get_registry
from jobs.control.tables import RunTable
from jobs.core.limits import validate_key
from jobs.db.clock import database_now
from jobs.models import Job, PauseKind, TenantWeight
from jobs.queue import flow, flow_state
from jobs.queue.flow import FlowLimits
from jobs.queue.flow_state import FlowState, TenantFlow
from jobs.queue.pauses import PauseRow
from jobs.scheduler import gauges
from jobs.scheduler.gauges import TENANT_ROWS

#: The weight of a tenant without a row, and the bounds of a row's (the table's constraint).
DEFAULT_WEIGHT = 1
WEIGHT_MIN, WEIGHT_MAX = 1, 1000

View = Callable[..., HttpResponse]


def urls(wrap: Callable[[View], View]) -> list[URLPattern]:
    """The page's URL, mounted under the jobs admin."""
    return [path("flow/", wrap(flow_page), name="jobs_flow")]


def controlled(registry: Registry) -> dict[str, FlowLimits]:
    """The registered job types with any flow control of their own, by name."""
    return {
        job_type.name: limits
        for job_type in registry
        if (limits := flow.limits_of(job_type.policy)) is not None
    }


#: How the page words each reason :func:`jobs.scheduler.gauges.held_back` gives.
REASONS = {
    gauges.PAUSED: _("paused"),
    gauges.THROTTLE: _("throttled"),
    gauges.GLOBAL: _("at its global limit"),
    gauges.RATE: _("rate limit: no token"),
    gauges.TENANT: _("tenants at their limit"),
}


def flow_data(
    now: datetime | None = None,
    *,
    registry: Registry | None = None,
    site_name: str = "admin",
) -> dict[str, Any]:
    """Everything the page shows, with a fixed number of statements, at ``now``.

    The types: every registered type with flow control, and every type a throttle holds now
    (a handler of a type without limits may throttle it too).
    """
    now = now or database_now()
    registry = registry or get_registry()
    limits = controlled(registry)
    pauses = {p.value: p for p in queue.paused() if p.kind == PauseKind.JOB_TYPE}
    names = sorted(set(limits) | {name for name, p in pauses.items() if p.until is not None})
    none = FlowLimits()
    states = flow_state.state({name: limits.get(name, none) for name in names})
    tenants: dict[str, list[TenantFlow]] = {}
    tokens: dict[str, dict[str, float]] = {}
    for name in names:
        found = limits.get(name)
        if found is None or not found.tenant_ordered:
            continue
        tenants[name] = flow_state.tenant_backlog(name, limit=TENANT_ROWS)
        if found.tenant_rate is not None and tenants[name]:
            tokens[name] = flow_state.tenant_tokens(name, [t.tenant for t in tenants[name]], found)
    weighted = _weighted({t.tenant for rows in tenants.values() for t in rows})
    types = []
    for name in names:
        job_type = registry.get(name)
        types.append(
            _type_row(
                name,
                job_type.policy if job_type is not None else None,
                limits.get(name),
                states.get(name),
                pauses.get(name),
                tenants.get(name),
                tokens.get(name, {}),
                weighted,
                now,
                site_name,
            )
        )
    return {
        "types": types,
        "limiting": sum(1 for row in types if row["limiting"]),
        "now": now,
        "tenant_rows": TENANT_ROWS,
    }


def _type_row(
    name: str,
    policy: Policy | None,
    limits: FlowLimits | None,
    state: FlowState | None,
    pause: PauseRow | None,
    tenants: list[TenantFlow] | None,
    tokens: dict[str, float],
    weighted: set[str],
    now: datetime,
    site_name: str,
) -> dict[str, Any]:
    held = gauges.held_back(limits, state, pause, tenants or (), tokens, now=now)
    running = state.running if state is not None else 0
    limit = limits.global_concurrency if limits is not None else None
    bucket = state.tokens if state is not None and limits is not None and limits.rate else None
    throttle = pause if pause is not None and pause.until is not None else None
    return {
        "name": name,
        "registered": policy is not None,
        "running": running,
        "limit": limit,
        "full": limit is not None and running >= limit,
        "tenant_limit": limits.tenant_concurrency if limits is not None else None,
        "rate": _rate(policy.rate_limit if policy else None),
        "tenant_rate": _rate(policy.tenant_rate_limit if policy else None),
        "tokens": None if bucket is None else f"{max(0.0, bucket):.1f}",
        "fair": bool(limits is not None and limits.fair),
        "lower_share": _percent(limits.lower_share if limits is not None else None),
        "due": state.due if state is not None else 0,
        "held": held.jobs,
        "limiting": [{"key": key, "text": REASONS[key]} for key in held.reasons],
        "throttle": throttle,
        "pause": pause if pause is not None and pause.until is None else None,
        "tenants": None
        if tenants is None
        else _tenant_rows(limits, tenants, tokens, weighted, set(held.tenants)),
        "tenants_cut": tenants is not None and len(tenants) >= TENANT_ROWS,
        "jobs_url": reverse(f"{site_name}:jobs_job_changelist")
        + "?"
        + urlencode({"name": name, "state__exact": "queued"}),
    }


def _tenant_rows(
    limits: FlowLimits | None,
    rows: list[TenantFlow],
    tokens: dict[str, float],
    weighted: set[str],
    full: set[str],
) -> list[dict[str, Any]]:
    """The listed tenants of a tenant-ordered type, with each one's weight and share.

    The claim shares each claim's jobs between the tenants with due jobs and room (under
    their tenant limit, a token in their bucket) in proportion to their weights, so that is
    a tenant's share while they all have due jobs: its weight over the sum of theirs. A
    tenant without due jobs, or without room, takes none. Among the listed tenants only.
    """
    starting = [row for row in rows if row.due and row.tenant not in full]
    total = sum(row.weight for row in starting)
    listed = []
    for row in rows:
        share = row.weight / total if total and row in starting else 0.0
        left = tokens.get(row.tenant)
        listed.append(
            {
                "tenant": row.tenant,
                "due": row.due,
                "running": row.running,
                "weight": row.weight,
                "weighted": row.tenant in weighted,
                "share": share,
                "share_text": f"{share:.0%}" if row.due else "—",
                "tokens": None if left is None else f"{max(0.0, left):.1f}",
                "limited": row.tenant in full,
            }
        )
    return listed


def _weighted(tenants: set[str]) -> set[str]:
    """Which of these tenants have a weight row (one query; the others weigh 1)."""
    if not tenants:
        return set()
    return set(TenantWeight.objects.filter(tenant__in=tenants).values_list("tenant", flat=True))


def _percent(share: float | None) -> str:
    """``20 %`` for 0.2, or "" for none."""
    return "" if share is None else f"{share:.0%}"


def _rate(rate: Rate | None) -> str:
    """``50/s, burst 5``, or "" for none."""
    if rate is None:
        return ""
    return gettext("%(rate)s, burst %(burst)s") % {
        "rate": str(rate),
        "burst": number_format(rate.capacity, force_grouping=True),
    }


def flow_page(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Flow control per job type, for users who may view jobs (view or change, as the admin)."""
    if not RunTable(Job).can_view(request.user):
        raise PermissionDenied(gettext("You may not view jobs."))
    context = {
        **site.each_context(request),
        "title": gettext("Flow control"),
        **flow_data(site_name=site.name),
        "may_view_weights": _may(request, "view") or _may(request, "change"),
        "may_change_weights": _may(request, "change"),
        "here": request.get_full_path(),
    }
    response = TemplateResponse(request, "admin/jobs/monitor/flow.html", context)
    return live.respond(request, response)


def _may(request: HttpRequest, action: str) -> bool:
    return request.user.has_perm(f"jobs.{action}_tenantweight")


# Tenant weights ------------------------------------------------------------------------------


class TenantWeightForm(forms.ModelForm):  # type: ignore[type-arg]  # generic in the stubs only
    """A tenant's weight, within the table's bounds; a tenant spelled as jobs spell it."""

    weight = forms.IntegerField(
        label=_("Weight"),
        min_value=WEIGHT_MIN,
        max_value=WEIGHT_MAX,
        initial=DEFAULT_WEIGHT,
        help_text=_(
            "Between 1 and 1,000. In a fair job type's order, a tenant of weight 2 gets twice "
            "the starts of a tenant of weight 1 while both have due jobs. Tenants without a "
            "row weigh 1."
        ),
    )

    class Meta:
        model = TenantWeight
        fields = ("tenant", "weight")

    def clean_tenant(self) -> str:
        tenant: str = self.cleaned_data["tenant"]
        try:
            validate_key(tenant, "tenant")
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return tenant


class TenantWeightAdmin(CheckedInputs, admin.ModelAdmin):  # type: ignore[type-arg]  # generic in stubs
    """Tenant weights: set, change and reset, each recorded with the old and the new weight.

    Setting a weight for a tenant that has no row adds one, and deleting a row puts the tenant
    back to weight 1: both are changes of a weight, so ``jobs.change_tenantweight`` allows
    them as well as the add and delete permissions do. A row's tenant is read-only once saved
    (changing it would move the weight to another tenant).
    """

    form = TenantWeightForm
    list_display = ("tenant", "weight")
    list_editable = ("weight",)
    search_fields = ("tenant",)
    ordering = ("tenant",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return super().has_add_permission(request) or self.has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_delete_permission(request, obj) or self.has_change_permission(
            request, obj
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ("tenant",) if obj else ()

    def get_queryset(self, request: HttpRequest) -> QuerySet[TenantWeight]:
        return super().get_queryset(request).order_by("tenant")

    def construct_change_message(  # type: ignore[override]  # a text message, not Django's JSON
        self, request: HttpRequest, form: forms.Form, formsets: Any, add: bool = False
    ) -> str:
        """Say what the weight was and is, in the log entry (the list's edits too)."""
        weight = form.cleaned_data.get("weight")
        if add:
            return f"Set weight {weight} via the admin (was {DEFAULT_WEIGHT}, the default)"
        before = form.initial.get("weight")
        return f"Changed weight from {before} to {weight} via the admin"
