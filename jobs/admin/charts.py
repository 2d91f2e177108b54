"""The console's charts as inline SVG: pure functions from plain numbers to escaped markup.

Nothing is fetched and nothing runs in the browser: a chart is markup in the page, so it reads
the same in a screenshot, without a network and in a live-refreshed region. Every mark carries
its numbers as data attributes (``data-series``, ``data-start`` as an ISO instant in UTC,
``data-value``) and a ``<title>`` tooltip, and every bin its ``data-total``, so tests and
scripts read numbers from the DOM, never from pixels. Axes are labelled in the current time
zone; a value of None is "no data" (a gap), never drawn as zero. A chart with no data at all
says so in words instead of drawing an empty axis.

Over 400 lines because the chart kinds share one axis and label layout: split, each would
carry its own copy of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.utils import timezone
from django.utils.formats import date_format, number_format
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _

from jobs.admin.display import span

WIDTH, HEIGHT = 600, 220
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 10, 34
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

OUTCOME_COLORS = {
    "succeeded": "#3a7d44",
    "failed": "#ba2121",
    "cancelled": "#8c8c8c",
    "retried": "#d08c00",
}
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#b07aa1",
    "#9c755f",
    "#edc948",
    "#ff9da7",
    "#bab0ac",
)
# Tick spacings tried, in minutes: the first that gives at most MAX_TICKS labels is used.
TICK_MINUTES = (1, 5, 10, 15, 30, 60, 120, 180, 360, 720, 1440, 2880, 4320, 10080)
MAX_TICKS = 7


def count(value: float) -> str:
    """A count as the console writes it: ``1,234``."""
    return number_format(int(value), force_grouping=True)


def seconds(value: float) -> str:
    """A duration in seconds as the console writes it: ``35 ms``, ``4.2s``, ``3m 05s``."""
    return span(value)


def percent(value: float) -> str:
    """A ratio (0 to 1) as a percentage: ``97.5 %``."""
    return f"{value * 100:.1f} %"


@dataclass(frozen=True)
class Series:
    """One named line or stack layer: a value per bin (None where there is no data)."""

    key: str  # data-series
    label: str
    values: Sequence[float | None]
    color: str
    href: str = ""  # the list this series stands for
    total: float | None = None  # shown in the legend, when it means something


@dataclass(frozen=True)
class Chart:
    """What a chart shows: its bins, its series and what to say around them."""

    name: str  # data-chart, unique on the page
    title: str
    starts: Sequence[datetime]
    step: timedelta
    series: Sequence[Series]
    empty: str  # said instead of the chart when there is no data
    href: str = ""  # the list the whole chart stands for
    link_text: str = ""
    note: str = ""
    pruned: int = 0  # leading bins older than the history kept
    value_text: Callable[[float], str] = count


def stacked_bars(chart: Chart) -> SafeString:
    """Bars per bin, the series stacked in order; each segment a mark, each bin its total."""
    n = len(chart.starts)
    totals = [
        None if i < chart.pruned else sum(s.values[i] or 0 for s in chart.series) for i in range(n)
    ]
    if not any(totals):
        return _empty(chart)
    ticks = _nice(max(t or 0 for t in totals), whole=True)
    top = ticks[-1]
    slot = PLOT_W / n
    width = max(1.0, slot * 0.8)
    marks: list[str] = []
    for i, start in enumerate(chart.starts):
        total = totals[i]
        if total is None:
            continue
        x = LEFT + i * slot + (slot - width) / 2
        when = _bin_text(start, chart.step)
        parts = [f"{s.label}: {chart.value_text(s.values[i] or 0)}" for s in chart.series]
        marks.append(
            f'<g class="jobs-bin" data-start="{_iso(start)}" data-total="{number(total)}">'
            f'<rect class="jobs-hit" x="{_c(LEFT + i * slot)}" y="{TOP}" width="{_c(slot)}" '
            f'height="{PLOT_H}" fill="transparent"><title>{escape(when)}: '
            f"{escape(', '.join(parts))}</title></rect>"
        )
        base: float = TOP + PLOT_H
        for s in chart.series:
            value = s.values[i] or 0
            if value <= 0:
                continue
            height = value / top * PLOT_H
            base -= height
            rect = (
                f'<rect class="jobs-mark" data-series="{escape(s.key)}" '
                f'data-start="{_iso(start)}" data-value="{number(value)}" x="{_c(x)}" '
                f'y="{_c(base)}" width="{_c(width)}" height="{_c(height)}" '
                f'fill="{escape(s.color)}"><title>{escape(when)}: {escape(s.label)} '
                f"{escape(chart.value_text(value))}</title></rect>"
            )
            marks.append(_linked(rect, s.href))
        marks.append("</g>")
    return _figure(chart, "bars", ticks, marks)


def lines(chart: Chart) -> SafeString:
    """A line per series with a dot per bin that has a value; no value, no line (a gap)."""
    values = [v for s in chart.series for v in s.values[chart.pruned :] if v is not None]
    if not values:
        return _empty(chart)
    ticks = _nice(max(values), whole=chart.value_text is count)
    top = ticks[-1]
    slot = PLOT_W / len(chart.starts)
    marks: list[str] = []
    for s in chart.series:
        points: list[tuple[float, float] | None] = []
        dots: list[str] = []
        for i, (start, value) in enumerate(zip(chart.starts, s.values, strict=True)):
            if value is None or i < chart.pruned:
                points.append(None)
                continue
            x, y = LEFT + (i + 0.5) * slot, TOP + PLOT_H - value / top * PLOT_H
            points.append((x, y))
            dots.append(
                f'<circle class="jobs-mark" data-series="{escape(s.key)}" '
                f'data-start="{_iso(start)}" data-value="{number(value)}" cx="{_c(x)}" '
                f'cy="{_c(y)}" r="2.5" fill="{escape(s.color)}"><title>'
                f"{escape(_bin_text(start, chart.step))}: {escape(s.label)} "
                f"{escape(chart.value_text(value))}</title></circle>"
            )
        path = _path(points)
        group = f'<g class="jobs-line" data-series="{escape(s.key)}">'
        if path:
            group += f'<path d="{path}" fill="none" stroke="{escape(s.color)}" stroke-width="1.6"/>'
        marks.append(_linked(group + "".join(dots) + "</g>", s.href))
    return _figure(chart, "lines", ticks, marks)


def sparkline(
    values: Sequence[float | None],
    *,
    label: str,
    color: str = PALETTE[0],
    value_text: Callable[[float], str] = count,
    width: int = 96,
    height: int = 22,
) -> SafeString:
    """A small line of ``values`` without axes; ``data-values`` lists them ("" for none)."""
    listed = ",".join("" if v is None else number(v) for v in values)
    present = [v for v in values if v is not None]
    head = (
        f'<svg class="jobs-spark" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(label)}" '
        f'data-values="{listed}">'
    )
    if not present:
        return mark_safe(f"{head}<title>{escape(label)}: {escape(_('no data'))}</title></svg>")
    top = max(present) or 1.0
    slot = width / max(1, len(values))
    points: list[tuple[float, float] | None] = [
        None
        if v is None
        else ((i + 0.5) * slot, height - 2 - v / top * (height - 4))  # 2 px clear of edges
        for i, v in enumerate(values)
    ]
    low, high = min(present), max(present)
    summary = _("%(label)s: %(low)s to %(high)s") % {
        "label": label,
        "low": value_text(low),
        "high": value_text(high),
    }
    dots = "".join(
        f'<circle cx="{_c(p[0])}" cy="{_c(p[1])}" r="1.5" fill="{escape(color)}"/>'
        for i, p in enumerate(points)
        if p is not None and _alone(points, i)
    )
    path = _path(points)
    line = f'<path d="{path}" fill="none" stroke="{escape(color)}" stroke-width="1.4"/>'
    return mark_safe(f"{head}<title>{escape(summary)}</title>{line if path else ''}{dots}</svg>")


# --- the parts -------------------------------------------------------------------------------


def _figure(chart: Chart, kind: str, ticks: Sequence[float], marks: Sequence[str]) -> SafeString:
    svg = (
        f'<svg class="jobs-chart-svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(chart.title)}" preserveAspectRatio="xMidYMid meet">'
        f"<title>{escape(chart.title)}</title>"
        f"{_y_axis(ticks, chart.value_text)}{_x_axis(chart.starts, chart.step)}"
        f"{_pruned(chart)}"
        f'<g class="jobs-marks">{"".join(marks)}</g></svg>'
    )
    return mark_safe(
        f'<figure class="jobs-chart" data-chart="{escape(chart.name)}" data-kind="{kind}">'
        f"{_caption(chart)}{svg}{_legend(chart)}{_note(chart)}</figure>"
    )


def _empty(chart: Chart) -> SafeString:
    return mark_safe(
        f'<figure class="jobs-chart" data-chart="{escape(chart.name)}" data-empty="true">'
        f'{_caption(chart)}<p class="jobs-nodata">{escape(chart.empty)}</p>{_note(chart)}'
        "</figure>"
    )


def _caption(chart: Chart) -> str:
    link = ""
    if chart.href:
        link = (
            f' <a class="jobs-chart-link" href="{escape(chart.href)}">'
            f"{escape(chart.link_text or _('List'))} &rsaquo;</a>"
        )
    title = f'<span class="jobs-chart-title">{escape(chart.title)}</span>'
    return f"<figcaption>{title}{link}</figcaption>"


def _legend(chart: Chart) -> str:
    items = []
    for s in chart.series:
        total = ""
        if s.total is not None:
            total = f' <span class="jobs-legend-total">{escape(chart.value_text(s.total))}</span>'
        swatch = (
            '<svg class="jobs-swatch" width="10" height="10" aria-hidden="true">'
            f'<rect width="10" height="10" fill="{escape(s.color)}"/></svg>'
        )
        body = f"{swatch} {escape(s.label)}{total}"
        if s.href:
            body = f'<a href="{escape(s.href)}">{body}</a>'
        data_total = "" if s.total is None else f' data-total="{number(s.total)}"'
        items.append(f'<li data-series="{escape(s.key)}"{data_total}>{body}</li>')
    return f'<ul class="jobs-legend">{"".join(items)}</ul>'


def _note(chart: Chart) -> str:
    return f'<p class="jobs-chart-note">{escape(chart.note)}</p>' if chart.note else ""


def _y_axis(ticks: Sequence[float], text: Callable[[float], str]) -> str:
    top = ticks[-1]
    parts = ['<g class="jobs-axis jobs-axis-y">']
    for tick in ticks:
        y = TOP + PLOT_H - tick / top * PLOT_H
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_c(y)}" y2="{_c(y)}" '
            f'stroke="currentColor" stroke-opacity="{0.45 if tick == 0 else 0.12}"/>'
            f'<text x="{LEFT - 6}" y="{_c(y + 4)}" text-anchor="end" font-size="11" '
            f'fill="currentColor">{escape(text(tick))}</text>'
        )
    parts.append("</g>")
    return "".join(parts)


def _x_axis(starts: Sequence[datetime], step: timedelta) -> str:
    slot = PLOT_W / len(starts)
    base = TOP + PLOT_H
    parts = ['<g class="jobs-axis jobs-axis-x">']
    for index, label in time_ticks(starts, step):
        x = LEFT + index * slot
        parts.append(
            f'<line x1="{_c(x)}" x2="{_c(x)}" y1="{base}" y2="{base + 4}" stroke="currentColor" '
            f'stroke-opacity="0.45"/><text x="{_c(x)}" y="{base + 16}" text-anchor="middle" '
            f'font-size="11" fill="currentColor">{escape(label)}</text>'
        )
    zone = timezone.localtime(starts[-1]).tzname() or ""
    parts.append(
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 3}" text-anchor="end" font-size="10" '
        f'fill="currentColor" fill-opacity="0.7">{escape(_("times in %s") % zone)}</text></g>'
    )
    return "".join(parts)


def _pruned(chart: Chart) -> str:
    if not chart.pruned:
        return ""
    width = PLOT_W / len(chart.starts) * chart.pruned
    return (
        f'<rect class="jobs-pruned" data-pruned="{chart.pruned}" x="{LEFT}" y="{TOP}" '
        f'width="{_c(width)}" height="{PLOT_H}" fill="currentColor" fill-opacity="0.08">'
        f"<title>{escape(_('Older than the history kept: no data'))}</title></rect>"
    )


def time_ticks(starts: Sequence[datetime], step: timedelta) -> list[tuple[int, str]]:
    """Where the time axis is labelled: the bins where a round local time begins.

    The spacing is the first of :data:`TICK_MINUTES` (a whole number of bins) that gives at
    most :data:`MAX_TICKS` labels; a bin is labelled when a multiple of that spacing, in local
    time, falls within it (bins are aligned in UTC, so in some zones it falls inside).
    """
    bin_minutes = step.total_seconds() / 60
    span_minutes = bin_minutes * len(starts)
    every = next(
        (
            m
            for m in TICK_MINUTES
            if m >= bin_minutes and m % bin_minutes == 0 and span_minutes / m <= MAX_TICKS
        ),
        TICK_MINUTES[-1],
    )
    ticks = []
    for index, start in enumerate(starts):
        local = timezone.localtime(start)
        offset = local.utcoffset() or timedelta()
        minute = (start.timestamp() + offset.total_seconds()) / 60
        if math.ceil(minute / every) * every < minute + bin_minutes:
            ticks.append((index, _tick_text(local, every)))
    return ticks


def _tick_text(local: datetime, every: float) -> str:
    if every >= 1440 or (local.hour, local.minute) == (0, 0):
        if (local.hour, local.minute) == (0, 0):
            return date_format(local, "M j")
        return date_format(local, "M j H:i")
    return date_format(local, "H:i")


def _bin_text(start: datetime, step: timedelta) -> str:
    """A bin as its tooltip names it: ``Dec 2 14:05-14:06``."""
    local = timezone.localtime(start)
    end = timezone.localtime(start + step)
    if step >= timedelta(days=1):
        return date_format(local, "M j")
    return f"{date_format(local, 'M j H:i')}-{date_format(end, 'H:i')}"


def _nice(maximum: float, *, whole: bool) -> list[float]:
    """Ticks from 0 to a round number at or above ``maximum``, in steps of 1, 2, 2.5 or 5
    times a power of ten (at least 1 for counts)."""
    if maximum <= 0:
        return [0.0, 1.0]
    raw = maximum / 4
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if whole:
        step = max(1.0, math.ceil(step))
    top = math.ceil(maximum / step - 1e-9) * step
    return [round(k * step, 9) for k in range(round(top / step) + 1)]


def _path(points: Sequence[tuple[float, float] | None]) -> str:
    """SVG path data joining consecutive points; a None breaks the line."""
    parts: list[str] = []
    pen_down = False
    for point in points:
        if point is None:
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{_c(point[0])} {_c(point[1])}")
        pen_down = True
    return " ".join(parts)


def _alone(points: Sequence[tuple[float, float] | None], i: int) -> bool:
    """Whether a point has no neighbour to draw a line to (then it is drawn as a dot)."""
    before = i > 0 and points[i - 1] is not None
    after = i + 1 < len(points) and points[i + 1] is not None
    return not (before or after)


def _linked(markup: str, href: str) -> str:
    return f'<a href="{escape(href)}">{markup}</a>' if href else markup


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat() if moment.tzinfo else moment.isoformat()


def number(value: float) -> str:
    """A number as a data attribute holds it: integers plain, others to six significant digits."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


def _c(value: float) -> str:
    """A coordinate, to two decimals."""
    return f"{value:.2f}".rstrip("0").rstrip(".")
