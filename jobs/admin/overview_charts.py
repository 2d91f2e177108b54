"""The overview's four charts over a window, from the console's history.

* **Attempts that ended**: per bin, stacked by outcome (succeeded, failed, cancelled, and
  retried: an attempt that failed and will run again).
* **Backlog by type**: the largest queued count sampled per bin and type (the scheduler's
  gauges duty samples once a minute); a bin without a sample is a gap, not a zero.
* **Queue latency**: p50 and p95, over every type, of how long attempts waited from due to
  start, read from the histograms of the attempts that ended in the bin.
* **Failures by cause**: failed attempts (terminal, not retried) per bin, stacked by error code.

Two reads, both bounded by the window: :func:`jobs.queue.rollup_reads.bins` and
:func:`jobs.queue.rollup_reads.backlog_points`. Each chart links to the list it summarises, and each
series where a list filters on it (failure monitor: state, error, job type and an age that
covers the window; jobs list: state and type). The lists hold job rows, which are kept for
their state's retention, the charts' history for longer: a chart whose window is longer than
a state's retention says that its older attempts are no longer listed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.urls import reverse
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from jobs.admin import charts
from jobs.admin.display import duration, second
from jobs.admin.windows import Frame
from jobs.core.conf import jobs_settings
from jobs.queue import history, rollup, rollup_reads
from jobs.runs import ErrorCode

OUTCOMES = ("succeeded", "failed", "cancelled", "retried")
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_SERIES = 8  # more types or causes than this are summed into "other"


def link(view: str, site_name: str = "admin", **params: str) -> str:
    """The URL of an admin list with its filters."""
    query = urlencode({k: v for k, v in params.items() if v})
    return f"{reverse(f'{site_name}:{view}')}{'?' + query if query else ''}"


def history_charts(frame: Frame, *, site_name: str = "admin") -> dict[str, Any]:
    """The overview's charts for ``frame`` as safe markup, with the notes they need."""
    ended = rollup_reads.bins(frame.since, frame.until, frame.step)
    samples = rollup_reads.backlog_points(frame.since, frame.until, frame.step)
    pruned = sum(1 for start in frame.starts if start + frame.step <= frame.kept_since)
    note = ""
    if frame.beyond_retention:
        note = _(
            "History is kept for %(kept)s (ROLLUP_RETENTION): the shaded bins are older and "
            "hold no data."
        ) % {"kept": duration(jobs_settings.ROLLUP_RETENTION.total_seconds())}
    common: dict[str, Any] = {
        "starts": frame.starts,
        "step": frame.step,
        "pruned": pruned,
        "note": note,
    }
    age = frame.window.age
    return {
        "finished": _finished(ended, frame, site_name, age, common),
        "backlog": _backlog(samples, frame, site_name, common),
        "latency": _latency(ended, frame, site_name, common),
        "failures": _failures(ended, frame, site_name, age, common),
        "per": frame.window.per,
        "ended": sum(b.count for b in ended),
    }


def per_bin(frame: Frame, items: Iterable[rollup.Bin], key: Any) -> dict[str, list[float | None]]:
    """Counts per ``key(bin)`` and frame position: zero where nothing ended."""
    values: dict[str, list[float | None]] = defaultdict(lambda: [0.0] * len(frame.starts))
    for item in items:
        index = frame.index(item.start)
        if index is not None:
            row = values[key(item)]
            row[index] = (row[index] or 0) + item.count
    return dict(values)


def _finished(
    ended: Sequence[rollup.Bin], frame: Frame, site: str, age: str, common: Mapping[str, Any]
) -> SafeString:
    counts = per_bin(frame, ended, lambda b: b.outcome)
    labels = {
        "succeeded": _("succeeded"),
        "failed": _("failed"),
        "cancelled": _("cancelled"),
        "retried": _("retried (will run again)"),
    }
    chart_common = {**common, "note": _joined(common["note"], unlisted(frame, TERMINAL))}
    series = [
        charts.Series(
            key=outcome,
            label=labels[outcome],
            values=counts.get(outcome, [0.0] * len(frame.starts)),
            color=charts.OUTCOME_COLORS[outcome],
            # A retried job is queued again, not finished: no list holds "retried attempts".
            href="" if outcome == "retried" else link("jobs_monitor", site, state=outcome, age=age),
            total=sum(v or 0 for v in counts.get(outcome, [])),
        )
        for outcome in OUTCOMES
    ]
    return charts.stacked_bars(
        charts.Chart(
            name="finished",
            # Attempts, not jobs: a retried attempt ends while its job goes on.
            title=_("Attempts that ended %(per)s, by outcome") % {"per": frame.window.per},
            series=series,
            empty=_("No data in this window: no attempt ended since %(since)s.")
            % {"since": _since(frame)},
            href=link("jobs_monitor", site, state="all", age=age),
            link_text=_("Jobs of this window"),
            **chart_common,
        )
    )


def _failures(
    ended: Sequence[rollup.Bin], frame: Frame, site: str, age: str, common: Mapping[str, Any]
) -> SafeString:
    failed = [b for b in ended if b.outcome == "failed"]
    counts = per_bin(frame, failed, lambda b: b.code or "")
    codes = dict(ErrorCode.choices)
    series = [
        charts.Series(
            key=code or "none",
            label=str(codes.get(code, code or _("no code"))),
            values=values,
            color=charts.PALETTE[i % len(charts.PALETTE)],
            href=link("jobs_monitor", site, error=code, age=age) if code in codes else "",
            total=sum(v or 0 for v in values),
        )
        for i, (code, values) in enumerate(_largest(counts))
    ]
    if ended:
        empty = _("No attempt failed in this window (%(n)s ended).") % {
            "n": charts.count(sum(b.count for b in ended))
        }
    else:
        empty = _("No data in this window: no attempt ended since %(since)s.") % {
            "since": _since(frame)
        }
    return charts.stacked_bars(
        charts.Chart(
            name="failures",
            title=_("Failures by cause"),
            series=series,
            empty=empty,
            href=link("jobs_monitor", site, age=age),
            link_text=_("Failure monitor"),
            **{**common, "note": _joined(common["note"], unlisted(frame, ("failed",)))},
        )
    )


def _latency(
    ended: Sequence[rollup.Bin], frame: Frame, site: str, common: Mapping[str, Any]
) -> SafeString:
    waits: list[rollup.Distribution] = [rollup.Distribution() for _start in frame.starts]
    for item in ended:
        index = frame.index(item.start)
        if index is not None:
            waits[index] = waits[index] + item.wait
    series = [
        charts.Series(
            key=key,
            label=label,
            values=[w.quantile(q) for w in waits],
            color=color,
        )
        for key, label, q, color in (
            ("p50", _("p50 (median)"), 0.5, charts.PALETTE[0]),
            ("p95", _("p95"), 0.95, charts.PALETTE[2]),
        )
    ]
    return charts.lines(
        charts.Chart(
            name="latency",
            title=_("Queue latency, all types (due to start)"),
            series=series,
            empty=_("No data in this window: no attempt that ran ended since %(since)s.")
            % {"since": _since(frame)},
            href=link("jobs_job_changelist", site, state="queued"),
            link_text=_("Queued jobs"),
            value_text=charts.seconds,
            **common,
        )
    )


def _backlog(
    samples: Sequence[rollup.BacklogPoint], frame: Frame, site: str, common: Mapping[str, Any]
) -> SafeString:
    values: dict[str, list[float | None]] = defaultdict(lambda: [None] * len(frame.starts))
    for point in samples:
        index = frame.index(point.start)
        if index is not None:
            values[point.name][index] = point.queued
    ranked = sorted(values.items(), key=lambda kv: (-max(v or 0 for v in kv[1]), kv[0]))
    shown, hidden = ranked[:MAX_SERIES], ranked[MAX_SERIES:]
    series = [
        charts.Series(
            key=name,
            label=name,
            values=row,
            color=charts.PALETTE[i % len(charts.PALETTE)],
            href=link("jobs_job_changelist", site, state="queued", name=name),
        )
        for i, (name, row) in enumerate(shown)
    ]
    chart_common = dict(common)
    if hidden:
        more = _("%(n)d smaller types not shown.") % {"n": len(hidden)}
        chart_common["note"] = f"{common['note']} {more}".strip()
    return charts.lines(
        charts.Chart(
            name="backlog",
            title=_("Backlog by type (queued, largest sample per bin)"),
            series=series,
            empty=_(
                "No backlog samples in this window: the scheduler samples the backlog once a "
                "minute while it runs (manage.py runscheduler)."
            ),
            href=link("jobs_job_changelist", site, state="queued"),
            link_text=_("Queued jobs"),
            **chart_common,
        )
    )


def _largest(
    counts: Mapping[str, list[float | None]],
) -> list[tuple[str, list[float | None]]]:
    """The series by total, largest first; past :data:`MAX_SERIES` the rest summed."""
    ranked = sorted(counts.items(), key=lambda kv: (-sum(v or 0 for v in kv[1]), kv[0]))
    if len(ranked) <= MAX_SERIES:
        return ranked
    kept, rest = ranked[: MAX_SERIES - 1], ranked[MAX_SERIES - 1 :]
    other: list[float | None] = [
        sum(row[i] or 0 for _code, row in rest) for i in range(len(rest[0][1]))
    ]
    return [*kept, (_("other"), other)]


def unlisted(frame: Frame, states: Sequence[str]) -> str:
    """What the lists no longer hold of a window: finished jobs are kept for their state's
    retention, the console's history for longer. Empty while the window is within it."""
    short = [
        (state, kept) for state in states if (kept := history.retention(state)) < frame.window.span
    ]
    if not short:
        return ""
    return _(
        "The lists keep finished jobs for less than this window (%(kept)s): older attempts "
        "are counted here but no longer listed."
    ) % {"kept": ", ".join(f"{state} {duration(kept.total_seconds())}" for state, kept in short)}


def _joined(*notes: str) -> str:
    return " ".join(note for note in notes if note)


def _since(frame: Frame) -> str:
    return second(frame.since)
