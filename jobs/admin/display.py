"""How the operator pages write times and durations: to the second, ages by the database clock."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import QuerySet
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

#: The annotation that carries PostgreSQL's "now" on every row of a console list.
NOW = "jobs_now"


def second(value: datetime | None) -> str:
    """A timestamp to the second in the current time zone ("2025-01-31 14:05:09"), or "—"."""
    return date_format(timezone.localtime(value), "Y-m-d H:i:s") if value else "—"


def duration(seconds: float) -> str:
    """An age to the second: "42s", "3m 05s", "2h 03m", "4d 02h"."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def span(seconds: float | None) -> str:
    """How long an attempt took: "35 ms", "4.2s", then as :func:`duration`; "—" if unknown."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))} ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return duration(seconds)


def relative(value: datetime, now: datetime) -> str:
    """How long ago ``value`` was at ``now`` ("3 min ago", "just now"), or how far ahead."""
    seconds = (now - value).total_seconds()
    if abs(seconds) < 1:
        return _("just now")
    amount = _amount(abs(seconds))
    if seconds > 0:
        return _("%(amount)s ago") % {"amount": amount}
    return _("in %(amount)s") % {"amount": amount}


def _amount(seconds: float) -> str:
    """A rounded amount of time: "12 s", "3 min", "5 h", "2 d"."""
    whole = int(seconds)
    if whole < 60:
        return _("%(n)d s") % {"n": whole}
    if whole < 3600:
        return _("%(n)d min") % {"n": whole // 60}
    if whole < 86400:
        return _("%(n)d h") % {"n": whole // 3600}
    return _("%(n)d d") % {"n": whole // 86400}


def moment(value: datetime | None, now: datetime | None = None) -> SafeString | str:
    """``2026-12-02 01:05:32 UTC (3 min ago)`` as a ``<time>`` element; "—" for no value.

    To the second, in the current time zone with its name; the age is relative to ``now``
    (PostgreSQL's clock, read once per page) and left out without one. The element carries
    the ISO instant for scripts and tests. ``{% when %}`` and the list columns write this.
    """
    if not isinstance(value, datetime):  # None, or a name the template does not know
        return "—"
    local = timezone.localtime(value)
    # Date and clock in spans of their own, so that a narrow table cell may break between them.
    stamp = format_html(
        '<span class="jobs-date">{}</span> <span class="jobs-clock">{} '
        '<span class="jobs-zone">{}</span></span>',
        date_format(local, "Y-m-d"),
        date_format(local, "H:i:s"),
        local.tzname() or "",
    )
    if now is None:
        return format_html('<time datetime="{}">{}</time>', value.isoformat(), stamp)
    age = relative(value, now)
    return format_html(
        '<time datetime="{}" title="{}">{} <span class="jobs-age">({})</span></time>',
        value.isoformat(),
        _("%(age)s, by the database clock") % {"age": age},
        stamp,
        age,
    )


def with_now(rows: QuerySet[Any]) -> QuerySet[Any]:
    """``rows`` with PostgreSQL's "now" on each (one value per statement), for :func:`now_of`."""
    annotated: QuerySet[Any] = rows.annotate(**{NOW: Now()})
    return annotated


def now_of(obj: Any) -> datetime | None:
    """The "now" :func:`with_now` put on a row, if its list or page read it that way."""
    value = getattr(obj, NOW, None)
    return value if isinstance(value, datetime) else None
