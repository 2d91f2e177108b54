"""Reading numbers from a rendered page: its elements and the charts' data attributes."""

from __future__ import annotations

from collections import defaultdict
from html.parser import HTMLParser


class Elements(HTMLParser):
    """Every element of a page as (tag, attributes, the charts it sits in)."""

    def __init__(self, markup: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], tuple[str, ...]]] = []
        self._open: list[tuple[str, str]] = []
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        charts = tuple(chart for _tag, chart in self._open if chart)
        self.found.append((tag, values, charts))
        if tag not in {"br", "img", "input", "link", "meta", "hr"}:
            self._open.append((tag, values.get("data-chart", "")))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag not in {name for name, _chart in self._open}:
            return
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def select(self, tag: str = "", chart: str = "", **attrs: str) -> list[dict[str, str]]:
        return [
            values
            for name, values, charts in self.found
            if (not tag or name == tag)
            and (not chart or chart in charts or values.get("data-chart") == chart)
            and all(values.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


def marks(page: Elements, chart: str) -> dict[str, dict[str, float]]:
    """A chart's marks: value per series and bin start."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    for tag in ("rect", "circle"):
        for mark in page.select(tag, chart, **{"class": "jobs-mark"}):
            found[mark["data-series"]][mark["data-start"]] = float(mark["data-value"])
    return dict(found)
