"""How the console writes a job's progress: a bar, "done / total (pct%) — note", and its age.

A running job's report is as fresh as its last lease renewal (``heartbeat_at``), which wrote
it; a finished job's is the last one its handler made (the outcome write carries it). The
value is read with :func:`jobs.core.progress.read`, so a hand-written column shows as no report.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from jobs.admin.display import moment
from jobs.core.progress import Progress, read
from jobs.runs import RunState

#: The live region of a job's page that holds its progress (jobs/static/jobs/live.js).
REGION = "progress"


def summary(report: Progress) -> str:
    """``3 / 10 (30%) — copying invoices``; ``3 done`` without a total."""
    if report.total is None:
        text = _("%(done)s done") % {"done": report.done}
    elif report.percent is None:
        text = f"{report.done} / {report.total}"
    else:
        text = f"{report.done} / {report.total} ({report.percent}%)"
    return f"{text} — {report.note}" if report.note else text


def bar(report: Progress, running: bool) -> SafeString | str:
    """A ``<progress>`` bar: indeterminate while running without a total, none after."""
    if report.total:
        return format_html(
            '<progress value="{}" max="{}">{}%</progress>',
            report.done,
            report.total,
            report.percent,
        )
    if report.total is None and running:
        return format_html("<progress>{}</progress>", _("running"))
    return ""


def detail(job: Any, now: datetime | None) -> SafeString:
    """The job page's progress: bar, summary, and when the report was last confirmed.

    Wrapped in a live region, so that a running job's page refreshes it in place.
    """
    report = read(job.progress)
    running = job.state == RunState.RUNNING
    if report is None:
        body = format_html(
            '<span class="jobs-progress-none">{}</span>',
            _("no report yet") if running else "—",
        )
    else:
        body = format_html(
            '{} <span class="jobs-progress-text">{}</span>{}',
            bar(report, running),
            summary(report),
            _context(job, report, running, now),
        )
    return format_html('<div class="jobs-progress" data-jobs-live="{}">{}</div>', REGION, body)


def _context(job: Any, report: Progress, running: bool, now: datetime | None) -> SafeString:
    earlier = report.attempt is not None and report.attempt != job.attempts
    parts = []
    if earlier:
        parts.append(format_html(_("reported by attempt {}"), report.attempt))
    if running and job.heartbeat_at is not None:
        parts.append(format_html(_("updated {}"), moment(job.heartbeat_at, now)))
    elif not running:
        parts.append(format_html("{}", _("the last report")))
    if not parts:
        return format_html("")
    return format_html(' <span class="jobs-progress-at">({})</span>', SafeString(", ".join(parts)))


def cell(value: Any, *, running: bool) -> SafeString | str:
    """A table cell for a stored report: the bar and the percentage (the count without a
    total), the whole summary in the title; "—" for no report."""
    report = read(value)
    if report is None:
        return "—"
    short = f"{report.percent}%" if report.percent is not None else str(report.done)
    return format_html(
        '<span class="jobs-progress" title="{}">{} {}</span>',
        summary(report),
        bar(report, running),
        short,
    )
