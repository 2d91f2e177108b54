"""The time windows the console's charts and performance page offer, and the bins of each.

A window ends with the bin "now" falls in (still filling) and is cut into whole bins aligned
to the epoch in UTC, as :func:`jobs.queue.rollup_reads.bins` groups them. Minute rows exist only for
the last :data:`jobs.queue.rollup.MINUTES_KEPT`, so only the hour window uses minute bins;
older data is hourly, and a bin finer than an hour would show a whole hour in its first bin.

=======  ================  ==================
window   bins              query value
=======  ================  ==================
hour     60 of 1 minute    ``?window=hour``
day      24 of 1 hour      ``?window=day``
week     28 of 6 hours     ``?window=week``
30 days  30 of 1 day       ``?window=30d``
=======  ================  ==================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.http import QueryDict
from django.utils.translation import gettext_lazy as _

from jobs.core.conf import jobs_settings

MINUTE, HOUR = timedelta(minutes=1), timedelta(hours=1)


@dataclass(frozen=True)
class Window:
    """A span of time back from now, cut into bins of ``step``."""

    key: str  # the query value
    label: Any  # lazily translated
    span: timedelta
    step: timedelta
    age: str  # the failure monitor's age filter ("newer than") that covers the window
    per: Any  # how a bin is named: "per minute"

    @property
    def bins(self) -> int:
        return int(self.span / self.step)


WINDOWS: dict[str, Window] = {
    w.key: w
    for w in (
        Window("hour", _("Last hour"), timedelta(hours=1), MINUTE, "1h", _("per minute")),
        Window("day", _("Last 24 hours"), timedelta(days=1), HOUR, "24h", _("per hour")),
        Window("week", _("Last 7 days"), timedelta(days=7), 6 * HOUR, "7d", _("per 6 hours")),
        Window("30d", _("Last 30 days"), timedelta(days=30), 24 * HOUR, "30d", _("per day")),
    )
}
DEFAULT = "hour"


@dataclass(frozen=True)
class Frame:
    """The bins of a window at one moment: ``[since, until)`` in ``len(starts)`` bins."""

    window: Window
    now: datetime
    starts: tuple[datetime, ...]

    @property
    def since(self) -> datetime:
        return self.starts[0]

    @property
    def until(self) -> datetime:
        return self.starts[-1] + self.window.step

    @property
    def step(self) -> timedelta:
        return self.window.step

    @property
    def kept_since(self) -> datetime:
        """The oldest moment the rollup still holds (its retention back from now)."""
        return self.now - jobs_settings.ROLLUP_RETENTION

    @property
    def beyond_retention(self) -> bool:
        """Whether the window starts before the oldest history the rollup keeps."""
        return self.since < self.kept_since

    def index(self, start: datetime) -> int | None:
        """The position of the bin starting at ``start``, or None outside the frame."""
        position, rest = divmod(start - self.since, self.step)
        if rest or not 0 <= position < len(self.starts):
            return None
        return int(position)


def frame(window: Window, now: datetime) -> Frame:
    """The window's bins at ``now``: the last one holds ``now``."""
    step = window.step.total_seconds()
    last = datetime.fromtimestamp(now.timestamp() // step * step, tz=UTC)
    starts = tuple(last - window.step * k for k in range(window.bins - 1, -1, -1))
    return Frame(window, now, starts)


def chosen(data: QueryDict, offered: Sequence[str]) -> Window:
    """The window the query string names among ``offered``; the default for anything else."""
    key = data.get("window", "")
    return WINDOWS[key if key in offered else DEFAULT]


def choices(data: QueryDict, offered: Sequence[str]) -> list[dict[str, Any]]:
    """The window selector's links: the query string kept, its window replaced."""
    current = chosen(data, offered).key
    links = []
    for key in offered:
        query = data.copy()
        query["window"] = key
        links.append(
            {
                "key": key,
                "label": WINDOWS[key].label,
                "url": f"?{query.urlencode()}",
                "selected": key == current,
            }
        )
    return links
