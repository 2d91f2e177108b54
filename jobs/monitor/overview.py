"""The jobs overview: counts per state and per type, the oldest due job, unsupported names.

Queued jobs are counted by :func:`jobs.queue.backlog`, whose cost is bounded whatever the
backlog holds: exact up to :data:`jobs.queue.BACKLOG_CAP` per type, shown as ``≈N`` (the
planner's estimate) above it, and due jobs as ``1,000+``. The oldest due job comes from
the same statement. Two aggregates read the other rows (per state, and per type for running
and failed rows); they never read the queued rows, and cost what the table holds besides the
backlog. Finished jobs in the history table are counted per state from PostgreSQL's
statistics of its partitions (shown as ``≈N``), and its failed rows per type exactly, as
they are the ones awaiting replay. Overdue schedules come from :func:`jobs.scheduler.status`
when the scheduler is there. What is paused comes from the small pauses table (a throttle's
timed pause only while in force), and the live
workers' capacity from the processes table (:func:`jobs.queue.processes.capacity`), one
query each.

The charts read the console's history (:mod:`jobs.queue.rollup`), which outlives the job
rows: one read of the attempts that ended in the window and one of the backlog samples, both
bounded by the window's bins (see :mod:`jobs.monitor.windows`), whatever the tables hold.

"Now" is PostgreSQL's, read once per page and passed down, as the scheduler reads it: a web
host with a fast clock would otherwise call a schedule that just fired overdue.
"""

from __future__ import annotations

import importlib
import importlib.util
from datetime import datetime
from typing import Any

from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.formats import number_format
from django.utils.translation import gettext as _

from jobs import queue
from jobs.control import pauses
from jobs.control.tables import RunTable
from jobs.models import Job, JobHistory, Pause, PauseKind
from jobs.monitor import live, windows
from jobs.monitor.display import duration, second
from jobs.monitor.overview_charts import history_charts
from jobs.monitor.views import age
from jobs.queue import BacklogRow
from jobs.registry import get_registry
from jobs.runs import RunState
from jobs.scheduler.clock import database_now

SCHEDULER_MODULE = "jobs.scheduler"
OVERVIEW_WINDOWS = ("hour", "day", "week")


def overview_data(
    now: datetime | None = None,
    window: windows.Window | None = None,
    *,
    site_name: str = "admin",
) -> dict[str, Any]:
    """Everything the overview page shows, with a fixed number of queries, at ``now``.

    ``now`` defaults to PostgreSQL's clock, never the web host's. Counts are display text
    (see :func:`shown`) so that an estimate never looks exact. The charts cover ``window``
    (default: the last hour) and link into ``site_name``'s lists.
    """
    now = now or database_now()
    frame = windows.frame(window or windows.WINDOWS[windows.DEFAULT], now)
    registry = get_registry()
    backlog = {row.name: row for row in queue.backlog(supported=registry.names())}
    per_state: dict[str, int] = {
        row["state"]: row["n"]
        for row in Job.objects.exclude(state=RunState.QUEUED)
        .order_by()
        .values("state")
        .annotate(n=Count("pk"))
    }
    per_state[RunState.QUEUED] = sum(row.queued for row in backlog.values())
    estimated = not all(row.queued_exact for row in backlog.values())
    archived = queue.history.estimated_rows()
    for state, count in archived.items():
        per_state[state] = per_state.get(state, 0) + count
    others = (RunState.RUNNING, RunState.FAILED)
    # The plugin's row type knows only "name", not the per-state counts annotated by name.
    per_type: dict[str, dict[str, Any]] = {
        row["name"]: dict(row)
        for row in Job.objects.filter(state__in=others)
        .order_by()
        .values("name")
        .annotate(**{state: Count("pk", filter=Q(state=state)) for state in others})
    }
    # Failed jobs awaiting replay are mostly in the history by now: count them there too.
    for row in (
        JobHistory.objects.filter(state=RunState.FAILED)
        .order_by()
        .values("name")
        .annotate(n=Count("pk"))
    ):
        counts = per_type.setdefault(row["name"], {"name": row["name"]})
        counts[RunState.FAILED] = counts.get(RunState.FAILED, 0) + row["n"]
    # A throttle's timed pause that has ended holds nothing back: it is not shown.
    in_force = Q(until__isnull=True) | Q(until__gt=now)
    paused = list(Pause.objects.filter(in_force).order_by("paused_at", "pk"))
    paused_types = {p.value: p for p in paused if p.kind == PauseKind.JOB_TYPE}
    oldest_due = min((r.oldest_due for r in backlog.values() if r.oldest_due), default=None)
    types = [
        {
            "name": name,
            "registered": name in registry,
            "paused": paused_types.get(name),
            **_queued(backlog.get(name)),
            **{state: per_type.get(name, {}).get(state, 0) for state in others},
        }
        for name in sorted(set(per_type) | set(backlog) | set(registry.names()))
    ]
    unsupported = [
        (name, shown(row.queued, estimate=not row.queued_exact))
        for name, row in sorted(backlog.items())
        if not row.supported
    ]
    return {
        "states": [
            (
                value,
                label,
                shown(
                    per_state.get(value, 0),
                    estimate=(estimated and value == RunState.QUEUED) or bool(archived.get(value)),
                ),
            )
            for value, label in RunState.choices
        ],
        "total": shown(sum(per_state.values()), estimate=estimated or any(archived.values())),
        "types": types,
        "oldest_due": oldest_due,
        "oldest_due_age": age(oldest_due, now),
        "unsupported": unsupported,
        "schedules": overdue_schedules(now),
        "pauses": [
            {
                "pause": p,
                "kind": p.get_kind_display(),
                "since": second(p.paused_at),
                "age": duration((now - p.paused_at).total_seconds()),
                "left": duration((p.until - now).total_seconds()) if p.until else "",
            }
            for p in paused
        ],
        "capacity": queue.processes.capacity(),
        "now": now,
        "frame": frame,
        "charts": history_charts(frame, site_name=site_name),
    }


def shown(count: int, *, estimate: bool = False, more_than: bool = False) -> str:
    """A count as the page shows it: ``1,234``; ``≈1,234`` (an estimate); ``1,000+``."""
    text = number_format(count, force_grouping=True)
    if estimate:
        return f"≈{text}"
    return f"{text}+" if more_than else text


def _queued(row: BacklogRow | None) -> dict[str, str]:
    """The queued and due cells of a type: exact, estimated, or "more than the cap"."""
    if row is None:
        return {"queued": shown(0), "due": shown(0)}
    due = shown(row.due) if row.due_exact else shown(queue.BACKLOG_CAP, more_than=True)
    return {"queued": shown(row.queued, estimate=not row.queued_exact), "due": due}


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
    window = windows.chosen(request.GET, OVERVIEW_WINDOWS)
    context = {
        **site.each_context(request),
        "title": _("Jobs overview"),
        **overview_data(window=window, site_name=site.name),
        "windows": windows.choices(request.GET, OVERVIEW_WINDOWS),
        "may_pause": pauses.can_pause(request.user),
        "may_view_processes": request.user.has_perm("jobs.view_process"),
        "here": request.get_full_path(),
    }
    response = TemplateResponse(request, "admin/jobs/monitor/overview.html", context)
    return live.respond(request, response)
