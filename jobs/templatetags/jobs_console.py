"""Template helpers of the operator console: how a moment is written on every page.

``{% when value now %}`` writes a timestamp to the second in the current time zone, with the
zone's name, and its age relative to ``now`` ("3 min ago", "in 12 s"). Pages pass ``now`` as
PostgreSQL's clock, read once per page, so ages agree with the workers whatever the web host's
clock says. The ``<time>`` element carries the ISO instant for scripts and tests.
"""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from jobs.conf import jobs_settings
from jobs.monitor.display import relative

register = template.Library()


@register.simple_tag
def when(value: datetime | None, now: datetime | None = None) -> SafeString | str:
    """``2026-12-02 01:05:32 UTC (3 min ago)`` as a ``<time>`` element; "—" for no value."""
    if not isinstance(value, datetime):  # None, or a name the template does not know
        return "—"
    local = timezone.localtime(value)
    stamp = date_format(local, "Y-m-d H:i:s")
    zone = local.tzname() or ""
    if now is None:
        return format_html(
            '<time datetime="{}">{} <span class="jobs-zone">{}</span></time>',
            value.isoformat(),
            stamp,
            zone,
        )
    return format_html(
        '<time datetime="{}" title="{}">{} <span class="jobs-zone">{}</span> '
        '<span class="jobs-age">({})</span></time>',
        value.isoformat(),
        _("%(age)s, by the database clock") % {"age": relative(value, now)},
        stamp,
        zone,
        relative(value, now),
    )


@register.simple_tag
def live_interval() -> str:
    """Seconds between live refreshes (``JOBS["LIVE_REFRESH"]``), for the live snippet."""
    return f"{jobs_settings.LIVE_REFRESH.total_seconds():g}"
