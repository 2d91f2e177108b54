"""The jobs overview: counts per state and per type, the oldest due job, unsupported names.

A job's row is in one of two homes (:data:`jobs.queue.counts.HOMES`): the jobs table, while
it is active or holds its key, then the history (the admin's *finished jobs*), for its state's
retention. Every count here counts both homes, and links to the lists that hold exactly the
rows it counts. So "Jobs per state" has a column per home, each count linking to that home's
list filtered to the state (:func:`per_state`).

Every count is bounded, whatever the tables hold. Queued jobs are counted by
:func:`jobs.queue.backlog`: exact up to :data:`jobs.queue.BACKLOG_CAP` per type, shown as
``≈N`` (the planner's estimate) above it, and due jobs as ``1,000+``; the oldest due job comes
from the same statement. Running and finished rows per home and state come from
:func:`jobs.queue.counts.state_counts` (one statement, each count stopping at
:data:`~jobs.queue.counts.COUNT_CAP` rows of one index or one state's partitions; past it
``≈N`` from PostgreSQL's statistics), failed rows per type from
:func:`jobs.queue.counts.failed_by_type` (at most the cap's rows per home; past it the counts
are floors, ``N+``), running jobs per type from the jobs table's index of running rows.
Overdue schedules come from :func:`jobs.scheduler.status`
when the scheduler is there. What is paused comes from the small pauses table (a throttle's
timed pause only while in force), and the live
workers' capacity from the processes table (:func:`jobs.queue.processes.capacity`), one
query each.

The charts read the console's history (:mod:`jobs.queue.rollup`), which outlives the job
rows: one read of the attempts that ended in the window and one of the backlog samples, both
bounded by the window's bins (see :mod:`jobs.admin.windows`), whatever the tables hold.

"Now" is PostgreSQL's, read once per page and passed down, as the scheduler reads it: a web
host with a fast clock would otherwise call a schedule that just fired overdue.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping
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
from jobs.admin import live, windows
from jobs.admin.display import duration, second
from jobs.admin.overview_charts import history_charts, link
from jobs.admin.views import age
from jobs.catalogue.registry import get_registry
from jobs.control import pauses
from jobs.control.tables import RunTable
from jobs.db.clock import database_now
from jobs.models import Job, Pause, PauseKind
from jobs.queue import BacklogRow
from jobs.queue.counts import HOMES, Counted
from jobs.runs import TERMINAL_STATES, RunState

SCHEDULER_MODULE = "jobs.scheduler"
#: The admin list of each home of a job's row (:data:`jobs.queue.counts.HOMES`).
LISTS = {"jobs": "jobs_job_changelist", "history": "jobs_jobhistory_changelist"}
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
    failed = queue.counts.failed_by_type()
    running: dict[str, int] = dict(
        Job.objects.filter(state=RunState.RUNNING)
        .order_by()
        .values("name")
        .annotate(n=Count("pk"))
        .values_list("name", "n")
    )
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
            "running": running.get(name, 0),
            **_failed(failed.of(name)),
            "urls": _type_links(name, site_name),
        }
        for name in sorted({*running, *failed.counts, *backlog, *registry.names()})
    ]
    unsupported = [
        (
            name,
            shown(row.queued, estimate=not row.queued_exact),
            link("jobs_job_changelist", site_name, name=name, state__exact="queued"),
        )
        for name, row in sorted(backlog.items())
        if not row.supported
    ]
    return {
        **per_state(backlog.values(), site_name),
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


def per_state(backlog: Iterable[BacklogRow], site_name: str = "admin") -> dict[str, Any]:
    """The "Jobs per state" table: each state's rows in the jobs list and in the finished
    jobs (the history), each count linking to the list that holds exactly those rows.

    A job is in one home or the other, never both, so a state's total counts each job once.
    """
    counts = dict(queue.counts.state_counts())
    rows = list(backlog)
    counts["jobs", RunState.QUEUED] = Counted(
        sum(row.queued for row in rows), estimate=not all(row.queued_exact for row in rows)
    )
    totals = {home: Counted(0) for home in HOMES}
    states = []
    for value, label in RunState.choices:
        cells: list[dict[str, str] | None] = []
        for home in HOMES:
            counted = counts.get((home, value))
            if counted is None:  # never there: only finished jobs move to the history
                cells.append(None)
                continue
            totals[home] += counted
            list_url = link(LISTS[home], site_name, state__exact=value)
            cells.append({"home": home, "text": counted_text(counted), "url": list_url})
        total = sum((counts.get((home, value), Counted(0)) for home in HOMES), Counted(0))
        states.append(
            {"value": value, "label": label, "cells": cells, "total": counted_text(total)}
        )
    return {
        "states": states,
        "totals": [
            {"home": home, "text": counted_text(totals[home]), "url": link(LISTS[home], site_name)}
            for home in HOMES
        ],
        "total": counted_text(sum(totals.values(), Counted(0))),
        "retention": _retention(),
    }


def counted_text(counted: Counted) -> str:
    """A :class:`~jobs.queue.counts.Counted` as the page shows it (see :func:`shown`)."""
    return shown(counted.n, estimate=counted.estimate, more_than=counted.floor)


def _retention() -> list[tuple[str, str]]:
    """How long the history keeps each finished state: what its counts cover."""
    labels = dict(RunState.choices)
    return [
        (str(labels[state]), duration(queue.history.retention(state).total_seconds()))
        for state in TERMINAL_STATES
    ]


def _failed(homes: Mapping[str, Counted]) -> dict[str, str]:
    """A type's failed cell: both homes added up, and what each holds (the cell's title)."""
    total = sum(homes.values(), Counted(0))
    where = {
        "jobs": _("%(n)s in the jobs list"),
        "history": _("%(n)s in the finished jobs"),
    }
    parts = [where[home] % {"n": counted_text(homes[home])} for home in HOMES if home in homes]
    return {"failed": counted_text(total), "failed_where": ", ".join(parts)}


def _type_links(name: str, site_name: str) -> dict[str, str]:
    """Where a type's counts are listed: its queued and running jobs in the jobs list, its
    failed jobs in the failure monitor, which shows the jobs list and the finished jobs."""
    return {
        "queued": link("jobs_job_changelist", site_name, name=name, state__exact="queued"),
        "running": link("jobs_job_changelist", site_name, name=name, state__exact="running"),
        "failed": link("jobs_monitor", site_name, job_type=name, state="failed"),
    }


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
