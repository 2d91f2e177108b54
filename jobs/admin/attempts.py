"""A job's attempt timeline on its admin page: every attempt, oldest first, newest last.

The attempts come from :func:`jobs.queue.attempts.of` (the row's log plus its columns), so
the page reads nothing the job's page has not loaded already; only a running attempt asks
PostgreSQL for "now", so that "running for" agrees with the workers' clock.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.template.loader import render_to_string
from django.utils.safestring import SafeString

from jobs.admin.display import duration, moment, span
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory
from jobs.queue import attempts

#: Characters of an error's last line shown before it is unfolded.
SUMMARY_MAX = 120


def timeline(job: Job | JobHistory, now: datetime | None = None) -> list[dict[str, Any]]:
    """The rows of the timeline, ready for the template (times to the second, with zone and
    age by the database clock, read once unless given)."""
    found = attempts.of(job)
    if now is None and found:
        now = database_now()
    rows = []
    for attempt in found:
        running = attempt.outcome == "running" and attempt.ended_at is None
        took = (
            duration((now - attempt.started_at).total_seconds())
            if running and now is not None and attempt.started_at is not None
            else span(attempt.duration)
        )
        rows.append(
            {
                "attempt": attempt.attempt,
                "started": moment(attempt.started_at, now),
                "ended": moment(attempt.ended_at, now),
                "took": took,
                "running": running,
                "worker": attempt.worker or "—",
                "outcome": attempt.outcome or "—",
                "code": attempt.code,
                "error": attempt.error,
                "summary": summary(attempt.error),
            }
        )
    return rows


def summary(error: str) -> str:
    """The line of an error that says most: a traceback's last one, cut to fit a row."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= SUMMARY_MAX else last[: SUMMARY_MAX - 1] + "…"


def render(job: Job | JobHistory) -> SafeString:
    """The timeline as the HTML table the job's page shows."""
    html = render_to_string("admin/jobs/job/attempts.html", {"attempts": timeline(job)})
    return SafeString(html)
