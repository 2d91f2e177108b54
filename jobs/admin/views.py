"""Admin views of the failure monitor: the merged list, the grouped view, replay.

They are mounted under the jobs admin (``JobAdmin.get_urls``) and wrapped in
``admin_site.admin_view``: staff only, CSRF-protected, never cached. Each table shows only
to users who may view it in the admin, and replays only for users with its replay
permission. Replay changes nothing on GET: the confirming POST does the work.

Each page reads PostgreSQL's clock once and passes it down: the age filters and the ages
shown agree with each other and with the workers, whatever the web host's clock says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.views.decorators.http import require_http_methods

from jobs.admin import live
from jobs.admin.forms import FilterForm, filter_query, link_filters
from jobs.catalogue.registry import get_registry
from jobs.control import failures, links
from jobs.control.replays import (
    REPLAY_ALL_LIMIT,
    check_permission,
    parse_tokens,
    replay,
    summary,
)
from jobs.control.tables import Filters, Row, RunTable, run_tables, visible_tables
from jobs.db.clock import database_now
from jobs.runs import RunState


def monitor(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Every run table's rows in one list: filters, job_id search, newest first, paginated.

    A job and the run row it drives are one line, the job's, linking to the row.
    """
    tables = _visible(request)
    filters = FilterForm(request.GET, tables).filters()
    now = database_now()
    page = failures.fetch_page(tables, filters, _page_number(request), now=now)
    may_replay = {t.label for t in tables if t.can_replay(request.user)}
    params = filter_query(request.GET)
    linked = links.links_for(page.rows, tables)
    rows = [
        {
            "row": row,
            "age": age(row.at, now),
            "replayable": row.replayable and row.table.label in may_replay,
            "link": linked.get(row.token),
        }
        for row in page.rows
    ]
    context = {
        **site.each_context(request),
        "title": _("Failure monitor"),
        "page": page,
        "rows": rows,
        "any_replayable": any(item["replayable"] for item in rows),
        "now": now,
        "filters": filters,
        "sidebar": link_filters(request.GET, tables, _job_types(tables)),
        "may_replay": bool(may_replay),
        "query": params.urlencode(),
        "here": request.get_full_path(),
    }
    return live.respond(
        request, TemplateResponse(request, "admin/jobs/monitor/monitor.html", context)
    )


def groups(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Failures counted by cause and by job type over the last hour, day and week."""
    tables = _visible(request)
    now = database_now()
    by_cause, by_type = failures.failure_groups(tables, now=now)
    base = reverse(f"{site.name}:jobs_monitor")
    context = {
        **site.each_context(request),
        "title": _("Failures by cause"),
        "sections": [
            {
                "title": _("By cause (error code)"),
                "key_title": _("error"),
                "lines": [_group(g, "error", now, base) for g in by_cause],
            },
            {
                "title": _("By job type"),
                "key_title": _("job type"),
                "lines": [_group(g, "job_type", now, base) for g in by_type],
            },
        ],
        "windows": [name for name, _window in failures.WINDOWS],
        "now": now,
    }
    return TemplateResponse(request, "admin/jobs/monitor/groups.html", context)


@require_http_methods(["GET", "POST"])
def replay_view(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Ask for confirmation (GET, or POST from the bulk form), replay on the confirming POST."""
    back = _next_url(request, site)
    data = request.POST if request.method == "POST" else request.GET
    confirming = request.method == "POST" and data.get("confirm") == "yes"
    if data.get("all") and not confirming:
        return _confirm_all(request, site, back)
    targets = parse_tokens(data.getlist("rows"), run_tables())
    named = sum(len(pks) for pks in targets.values())
    if named > REPLAY_ALL_LIMIT:  # no page sends more; a crafted request may not either
        messages.warning(
            request,
            _("Replay at most %(limit)d rows at once; %(named)d were named.")
            % {"limit": REPLAY_ALL_LIMIT, "named": named},
        )
        return HttpResponseRedirect(back)
    if confirming:
        results = replay(request.user, targets, via="the admin failure monitor")
        done = any(r.replayed for r in results)
        messages.add_message(
            request, messages.SUCCESS if done else messages.WARNING, summary(results)
        )
        return HttpResponseRedirect(back)
    if not targets:
        messages.warning(request, _("Select the rows to replay first."))
        return HttpResponseRedirect(back)
    return confirmation(request, site, targets, back)


def confirmation(
    request: HttpRequest,
    site: AdminSite,
    targets: Mapping[RunTable, Sequence[Any]],
    back: str,
    *,
    matching: int | None = None,
    capped: bool = False,
    filters: str = "",
    limit: int | None = None,
) -> HttpResponse:
    """The confirmation page for replaying ``targets`` (also used by the admin actions).

    ``matching`` is how many rows the filter matched when only ``limit`` of them were taken.
    """
    check_permission(request.user, targets)
    rows: list[Row] = []
    for table, pks in targets.items():
        qs = table.model._default_manager.filter(pk__in=pks)
        rows += table.rows(qs, Filters(state=""), len(pks))
    eligible = [row for row in rows if row.replayable]
    linked = links.links_for(eligible, visible_tables(request.user))
    sections = [
        {
            "table": table,
            "rows": [(row, linked.get(row.token)) for row in eligible if row.table is table],
        }
        for table in targets
    ]
    context = {
        **site.each_context(request),
        "title": _("Replay failed work?"),
        "sections": [s for s in sections if s["rows"]],
        "eligible": len(eligible),
        "skipped": sum(len(pks) for pks in targets.values()) - len(eligible),
        "tokens": " ".join(row.token for row in eligible),
        "matching": matching,
        "capped": capped,
        "filters": filters,
        "limit": REPLAY_ALL_LIMIT if limit is None else limit,
        "next": back,
        "action": reverse(f"{site.name}:jobs_monitor_replay"),
    }
    return TemplateResponse(request, "admin/jobs/monitor/replay_confirmation.html", context)


def _confirm_all(request: HttpRequest, site: AdminSite, back: str) -> HttpResponse:
    """Replay all matching this filter: the newest ``REPLAY_ALL_LIMIT`` eligible rows.

    Unlike the monitor, which ignores a bad filter value, this refuses one: dropping a filter
    would widen "all matching" to every row the user may replay.
    """
    visible = _visible(request)
    tables = [t for t in visible if t.can_replay(request.user)]
    if not tables:
        raise PermissionDenied(_("You may not replay any run table."))
    form = FilterForm(request.GET, visible)
    if not form.is_valid():
        problems = "; ".join(
            f"{name}: {' '.join(str(e) for e in errs)}" for name, errs in form.errors.items()
        )
        messages.warning(
            request,
            _("Nothing to replay: the filter is not valid (%(problems)s).")
            % {"problems": problems},
        )
        return HttpResponseRedirect(back)
    filters = form.filters()
    if filters.module:  # one table named: the user must be allowed to replay that one
        check_permission(request.user, [t for t in visible if t.label == filters.module])
    rows, matching, capped = failures.eligible_rows(
        tables, filters, REPLAY_ALL_LIMIT, now=database_now()
    )
    targets: dict[RunTable, list[Any]] = {}
    for row in rows:
        targets.setdefault(row.table, []).append(row.pk)
    shown = filter_query(request.GET)
    return confirmation(
        request,
        site,
        targets,
        back,
        matching=matching,
        capped=capped,
        filters=", ".join(f"{key}={value}" for key, value in shown.items()) or _("none"),
    )


def _group(group: failures.Group, key: str, now: datetime, base: str) -> dict[str, Any]:
    """A grouped-view line, each count linking to the monitor filtered down to its rows."""
    params = QueryDict(mutable=True)
    params.update({"module": group.module, key: group.key, "state": RunState.FAILED})

    def link(window: str) -> str:
        params["age"] = window
        return f"{base}?{params.urlencode()}"

    return {
        "group": group,
        "counts": [(group.counts.get(name, 0), link(name)) for name, _w in failures.WINDOWS],
        "first": age(group.first, now),
        "last": age(group.last, now),
    }


def _visible(request: HttpRequest) -> list[RunTable]:
    tables = visible_tables(request.user)
    if not tables:
        raise PermissionDenied(_("You may not view any run table."))
    return tables


def _job_types(tables: Sequence[RunTable]) -> list[str]:
    """Filter choices: the registered job types and the fixed types of domain tables."""
    names = set(get_registry().names()) | {t.job_type for t in tables if t.job_type}
    return sorted(names)


def _page_number(request: HttpRequest) -> int:
    try:
        return int(request.GET.get("p", "1"))
    except ValueError:
        return 1


def _next_url(request: HttpRequest, site: AdminSite) -> str:
    """Where to go back to: a safe ``next`` from the request, else the monitor."""
    candidate = request.POST.get("next") or request.GET.get("next") or ""
    if candidate and url_has_allowed_host_and_scheme(
        candidate, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return candidate
    return reverse(f"{site.name}:jobs_monitor")


def age(value: datetime | None, now: datetime) -> str:
    """A short age for a table cell ("5m", "3h", "2d")."""
    if value is None:
        return ""
    seconds = max(0, int((now - value).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
