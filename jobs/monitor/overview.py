"""The jobs overview: counts per state and per type, the oldest due job, unsupported names.

Four aggregate queries on the jobs table, each returning a handful of rows: per state
(``GROUP BY state``), per type and state for the active and failed rows, the oldest due
``run_after``, and :func:`jobs.queue.backlog` for queued counts per type marked supported or
not. Overdue schedules come from :func:`jobs.scheduler.status` when the scheduler is there.

"Now" is PostgreSQL's, read once per page and passed down, as the scheduler reads it: a web
host with a fast clock would otherwise call a schedule that just fired overdue.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Min, Q
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _

from jobs import queue
from jobs.models import Job
from jobs.monitor.tables import RunTable
from jobs.monitor.views import age
from jobs.registry import get_registry
from jobs.runs import RunState
from jobs.scheduler.clock import database_now

SCHEDULER_MODULE = "jobs.scheduler"


def overview_data(now: datetime | None = None) -> dict[str, Any]:
    """Everything the overview page shows, with a fixed number of queries, at ``now``.

    ``now`` defaults to PostgreSQL's clock, never the web host's.
    """
    now = now or database_now()
    per_state = {
        row["state"]: row["n"]
        for row in Job.objects.order_by().values("state").annotate(n=Count("pk"))
    }
    active = (RunState.QUEUED, RunState.RUNNING, RunState.FAILED)
    # The plugin's row type knows only "name", not the per-state counts annotated by name.
    per_type: dict[str, Mapping[str, Any]] = {
        row["name"]: row
        for row in Job.objects.filter(state__in=active)
        .order_by()
        .values("name")
        .annotate(
            **{state: Count("pk", filter=Q(state=state)) for state in active},
        )
    }
    oldest_due = Job.objects.filter(state=RunState.QUEUED, run_after__lte=Now()).aggregate(
        oldest=Min("run_after")
    )["oldest"]
    registry = get_registry()
    backlog = queue.backlog(supported=registry.names())
    due: dict[str, int] = {}
    for row in backlog:
        due[row.name] = due.get(row.name, 0) + row.due
    unsupported: dict[str, int] = {}
    for row in backlog:
        if not row.supported:
            unsupported[row.name] = unsupported.get(row.name, 0) + row.queued
    types = [
        {
            "name": name,
            "registered": name in registry,
            "due": due.get(name, 0),
            **{state: per_type.get(name, {}).get(state, 0) for state in active},
        }
        for name in sorted(set(per_type) | set(registry.names()))
    ]
    return {
        "states": [(value, label, per_state.get(value, 0)) for value, label in RunState.choices],
        "total": sum(per_state.values()),
        "types": types,
        "oldest_due": oldest_due,
        "oldest_due_age": age(oldest_due, now),
        "unsupported": sorted(unsupported.items()),
        "schedules": overdue_schedules(now),
    }


def overdue_schedules(now: datetime) -> list[dict[str, Any]] | None:
    """Schedules past their misfire grace, or None while no scheduler is installed.

    Reads :func:`jobs.scheduler.status` (one query) when the scheduler package exists.
    """
    if importlib.util.find_spec(SCHEDULER_MODULE) is None:
        return None
    status = getattr(importlib.import_module(SCHEDULER_MODULE), "status", None)
    if status is None:
        return None
    return [
        {
            "name": item.name,
            "job": item.job,
            "due_at": item.next_due,
            "late": age(item.next_due, now),
        }
        for item in status(now=now)
        if item.overdue
    ]


def overview(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """The jobs table at a glance, for users who may view jobs (view or change, as the admin)."""
    if not RunTable(Job).can_view(request.user):
        raise PermissionDenied(_("You may not view jobs."))
    context = {
        **site.each_context(request),
        "title": _("Jobs overview"),
        **overview_data(),
    }
    return TemplateResponse(request, "admin/jobs/monitor/overview.html", context)
