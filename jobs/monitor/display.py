"""How the operator pages write times and durations: to the second, ages by the database clock."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from django.utils.formats import date_format
from django.utils.translation import gettext as _


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
