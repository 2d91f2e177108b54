"""Template helpers of the operator console: how a moment is written on every page.

``{% when value now %}`` writes a timestamp to the second in the current time zone, with the
zone's name, and its age relative to ``now`` ("3 min ago", "in 12 s"). Pages pass ``now`` as
PostgreSQL's clock, read once per page, so ages agree with the workers whatever the web host's
clock says. The ``<time>`` element carries the ISO instant for scripts and tests.
"""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils.safestring import SafeString

from jobs.admin.display import moment
from jobs.core.conf import jobs_settings

register = template.Library()


@register.simple_tag
def when(value: datetime | None, now: datetime | None = None) -> SafeString | str:
    """``2026-12-02 01:05:32 UTC (3 min ago)`` as a ``<time>`` element; "—" for no value."""
    return moment(value, now)


@register.simple_tag
def live_interval() -> str:
    """Seconds between live refreshes (``JOBS["LIVE_REFRESH"]``), for the live snippet."""
    return f"{jobs_settings.LIVE_REFRESH.total_seconds():g}"
