"""The per-type performance page: how each job type ran over a window, from the history.

Figures per job type, over the attempts that ended in the window
(:func:`jobs.queue.rollup_reads.bins`, one read bounded by the window's bins):

* **attempts**: every attempt that ended: succeeded, failed, cancelled or retried;
* **success rate**: succeeded / (succeeded + failed + cancelled), the jobs that ended for good;
  a retried attempt is not an end, so it counts in neither part;
* **run time p50 / p95**: of the attempts that ran (a job cancelled while queued never did);
* **queue latency p95**: how long attempts waited from due to start;
* **retries per job**: retried attempts / (succeeded + failed + cancelled).

Quantiles come from the rollup's histograms, within about ±20 % (:mod:`jobs.queue.rollup`).
Each figure has a sparkline over the window's bins (see :mod:`jobs.admin.windows`), where a
bin with nothing to measure is a gap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.contrib.admin import AdminSite
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, QueryDict
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from jobs.admin import charts, live, windows
from jobs.admin.overview_charts import link, unlisted
from jobs.catalogue.registry import get_registry
from jobs.control.tables import RunTable
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.queue import rollup, rollup_reads
from jobs.queue.rollup import Distribution

PERFORMANCE_WINDOWS = ("hour", "day", "week", "30d")
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Tally:
    """One job type's attempts in one bin (or the whole window)."""

    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    run: Distribution = field(default_factory=Distribution)
    wait: Distribution = field(default_factory=Distribution)

    def add(self, item: rollup.Bin) -> None:
        self.outcomes[item.outcome] += item.count
        self.run = self.run + item.run
        self.wait = self.wait + item.wait

    @property
    def attempts(self) -> int:
        return sum(self.outcomes.values())

    @property
    def ended(self) -> int:
        return sum(self.outcomes[o] for o in TERMINAL)

    def success_rate(self) -> float | None:
        return self.outcomes["succeeded"] / self.ended if self.ended else None

    def retries_per_job(self) -> float | None:
        return self.outcomes["retried"] / self.ended if self.ended else None


@dataclass(frozen=True)
class Figure:
    """A column of the table: its key (for sorting and data attributes) and how to read it."""

    key: str
    label: Any
    read: Callable[[Tally], float | None]
    text: Callable[[float], str]
    color: str


FIGURES = (
    Figure("attempts", gettext_lazy("attempts"), lambda t: t.attempts, charts.count, "#4e79a7"),
    Figure(
        "success",
        gettext_lazy("success rate"),
        Tally.success_rate,
        charts.percent,
        charts.OUTCOME_COLORS["succeeded"],
    ),
    Figure(
        "run50",
        gettext_lazy("run time p50"),
        lambda t: t.run.quantile(0.5),
        charts.seconds,
        "#76b7b2",
    ),
    Figure(
        "run95",
        gettext_lazy("run time p95"),
        lambda t: t.run.quantile(0.95),
        charts.seconds,
        "#59a14f",
    ),
    Figure(
        "wait95",
        gettext_lazy("queue latency p95"),
        lambda t: t.wait.quantile(0.95),
        charts.seconds,
        "#e15759",
    ),
    Figure(
        "retries",
        gettext_lazy("retries per job"),
        Tally.retries_per_job,
        lambda v: f"{v:.2f}",
        charts.OUTCOME_COLORS["retried"],
    ),
)
SORTS = ("name", *(f.key for f in FIGURES))
DEFAULT_SORT = "-attempts"


def urls(
    wrap: Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]],
) -> list[URLPattern]:
    """The page's URLs, mounted under the jobs admin."""
    return [path("performance/", wrap(performance_page), name="jobs_performance")]


def performance_data(
    frame: windows.Frame, *, sort: str = DEFAULT_SORT, site_name: str = "admin"
) -> list[dict[str, Any]]:
    """A row per job type (registered, or seen in the window) with its figures and sparklines."""
    whole: dict[str, Tally] = defaultdict(Tally)
    binned: dict[str, list[Tally]] = defaultdict(lambda: [Tally() for _s in frame.starts])
    for item in rollup_reads.bins(frame.since, frame.until, frame.step):
        index = frame.index(item.start)
        if index is None:
            continue
        whole[item.name].add(item)
        binned[item.name][index].add(item)
    rows = []
    for name in set(whole) | set(get_registry().names()):
        tally = whole.get(name, Tally())
        per_bin = binned.get(name) or [Tally() for _s in frame.starts]
        rows.append(
            {
                "name": name,
                "attempts": tally.attempts,
                "outcomes": dict(tally.outcomes),
                "figures": [_cell(f, tally, per_bin) for f in FIGURES],
                "jobs_url": link("jobs_job_changelist", site_name, name=name),
                "failures_url": link(
                    "jobs_monitor", site_name, job_type=name, age=frame.window.age
                ),
            }
        )
    return _sorted(rows, sort)


def _cell(figure: Figure, tally: Tally, per_bin: Sequence[Tally]) -> dict[str, Any]:
    value = figure.read(tally)
    points = [figure.read(t) if t.attempts else None for t in per_bin]
    return {
        "key": figure.key,
        "value": value,
        "data": "" if value is None else charts.number(value),
        "text": "—" if value is None else figure.text(value),
        "spark": _spark(figure, points),
    }


def _spark(figure: Figure, points: Sequence[float | None]) -> SafeString:
    return charts.sparkline(
        points, label=str(figure.label), color=figure.color, value_text=figure.text
    )


def _sorted(rows: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    """Rows by ``sort`` (a key of :data:`SORTS`, ``-`` first for descending); no value last."""
    descending = sort.startswith("-")
    key = sort.lstrip("-")
    if key not in SORTS:
        return _sorted(rows, DEFAULT_SORT)
    rows.sort(key=lambda r: r["name"])
    if key == "name":
        return rows[::-1] if descending else rows
    position = SORTS.index(key) - 1

    def value(row: dict[str, Any]) -> float:
        found = row["figures"][position]["value"]
        return float(found) if found is not None else 0.0

    present = [r for r in rows if r["figures"][position]["value"] is not None]
    absent = [r for r in rows if r["figures"][position]["value"] is None]
    present.sort(key=value, reverse=descending)
    return present + absent


def _headers(data: QueryDict, sort: str) -> list[dict[str, Any]]:
    """Column headers linking to their sort; a second click reverses it."""
    current = sort.lstrip("-")
    columns = [("name", _("job type")), *((f.key, f.label) for f in FIGURES)]
    headers = []
    for key, label in columns:
        first = key if key == "name" else f"-{key}"  # figures read best largest first
        target = (key if sort.startswith("-") else f"-{key}") if key == current else first
        query = data.copy()
        query["sort"] = target
        headers.append(
            {
                "key": key,
                "label": label,
                "url": f"?{query.urlencode()}",
                "sorted": ("descending" if sort.startswith("-") else "ascending")
                if key == current
                else "",
            }
        )
    return headers


def performance_page(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    """Per job type over the chosen window: attempts, success rate, times, retries."""
    if not RunTable(Job).can_view(request.user):
        raise PermissionDenied(_("You may not view jobs."))
    window = windows.chosen(request.GET, PERFORMANCE_WINDOWS)
    sort = request.GET.get("sort", DEFAULT_SORT)
    if sort.lstrip("-") not in SORTS:
        sort = DEFAULT_SORT
    frame = windows.frame(window, database_now())
    context = {
        **site.each_context(request),
        "title": _("Performance by job type"),
        "rows": performance_data(frame, sort=sort, site_name=site.name),
        "headers": _headers(request.GET, sort),
        "windows": windows.choices(request.GET, PERFORMANCE_WINDOWS),
        "frame": frame,
        "now": frame.now,
        "window": window,
        # The failures links list job rows, kept for FAILED_RETENTION: say when that is shorter.
        "unlisted": unlisted(frame, ("failed",)),
    }
    response = TemplateResponse(request, "admin/jobs/monitor/performance.html", context)
    return live.respond(request, response)
