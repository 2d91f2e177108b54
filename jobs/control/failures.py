"""Failures across run tables: a merged page over every table, and failures grouped by cause.

Time windows ("last hour") are measured on PostgreSQL's clock unless a test passes ``now``.

Per page and per table: one capped ``COUNT`` and, for tables that have matching rows, one
``SELECT … ORDER BY <time> DESC, pk DESC LIMIT <page end>`` projecting only the common
columns (error detail cut in SQL). ``heapq.merge`` interleaves the sorted streams. Nothing
loads a whole table, and no query runs per row. Pages stop at ``MAX_ROWS`` rows deep.

A run row driven by a job that the same list shows is left out of its table's queries (see
:func:`jobs.control.links.fold`): one failure, one line, counted once.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, F, Max, Min, Q, Value
from django.db.models.functions import Now

from jobs.control.links import fold, foldable
from jobs.control.tables import Filters, Row, RunTable
from jobs.runs import RunState

PER_PAGE = 50
MAX_ROWS = 10_000  # counts stop here ("10,000+") and pages go no deeper
WINDOWS: tuple[tuple[str, timedelta], ...] = (
    ("1h", timedelta(hours=1)),
    ("24h", timedelta(hours=24)),
    ("7d", timedelta(days=7)),
)


@dataclass(frozen=True)
class Page:
    """One page of the merged monitor, with per-table counts (each capped at ``MAX_ROWS``)."""

    rows: list[Row]
    number: int
    per_page: int
    counts: dict[str, int]
    capped: bool
    # Tables whose rows are shown on their job's line when that job is listed too.
    folded: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def num_pages(self) -> int:
        return max(1, math.ceil(min(self.total, MAX_ROWS) / self.per_page))

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def has_next(self) -> bool:
        return self.number < self.num_pages


def fetch_page(
    tables: Sequence[RunTable],
    filters: Filters,
    number: int = 1,
    *,
    per_page: int = PER_PAGE,
    now: datetime | None = None,
) -> Page:
    """Page ``number`` (from 1) of the rows matching ``filters`` in every table, newest first."""
    queries = fold([(t, qs) for t in tables if (qs := t.filtered(filters, now=now)) is not None])
    counts = {t.label: t.count(qs, MAX_ROWS) for t, qs in queries}
    total = min(sum(counts.values()), MAX_ROWS)
    num_pages = max(1, math.ceil(total / per_page))
    number = min(max(1, number), num_pages)
    start, end = (number - 1) * per_page, number * per_page
    streams = [
        t.rows(qs, filters, min(end, counts[t.label])) for t, qs in queries if counts[t.label]
    ]
    rows = merged(streams, start, end)
    capped = any(count >= MAX_ROWS for count in counts.values())
    return Page(rows, number, per_page, counts, capped, tuple(foldable(t for t, _ in queries)))


def merged(streams: Sequence[Sequence[Row]], start: int, end: int) -> list[Row]:
    """Rows ``start:end`` of the newest-first merge of already sorted streams."""
    merge = heapq.merge(*streams, key=Row.sort_key, reverse=True)
    return list(itertools.islice(merge, start, end))


def eligible_rows(
    tables: Sequence[RunTable], filters: Filters, limit: int, *, now: datetime | None = None
) -> tuple[list[Row], int, bool]:
    """The newest ``limit`` replayable rows matching ``filters``, their count, and if capped.

    A run row whose job is among them is left out: replaying the job requeues its row.
    """
    queries = fold(
        [(t, qs) for t in tables if (qs := t.filtered(filters, now=now, eligible=True)) is not None]
    )
    counts = [t.count(qs, MAX_ROWS) for t, qs in queries]
    pairs = zip(queries, counts, strict=True)
    streams = [t.rows(qs, filters, min(limit, n)) for (t, qs), n in pairs if n]
    return merged(streams, 0, limit), sum(counts), any(n >= MAX_ROWS for n in counts)


@dataclass
class Group:
    """Failures of one (module, key) over the last hour, day and week, and since when."""

    module: str
    key: str
    counts: dict[str, int] = field(default_factory=dict)
    first: datetime | None = None
    last: datetime | None = None

    def add(self, counts: dict[str, int], first: datetime | None, last: datetime | None) -> None:
        for name, value in counts.items():
            self.counts[name] = self.counts.get(name, 0) + value
        self.first = min(filter(None, (self.first, first)), default=None)
        self.last = max(filter(None, (self.last, last)), default=None)


def failure_groups(
    tables: Sequence[RunTable], *, now: datetime | None = None
) -> tuple[list[Group], list[Group]]:
    """Failures of the last 7 days by (module, error code) and by (job type, module).

    One aggregate query per table over its failed rows of the week (the jobs table answers
    it from its ``(state, finished_at)`` index), grouped by code and job type together.
    """
    clock = Now() if now is None else Value(now)
    longest = WINDOWS[-1][1]
    by_cause: dict[tuple[str, str], Group] = {}
    by_type: dict[tuple[str, str], Group] = {}
    for table in tables:
        time = "finished_at" if "finished_at" in table.fields else "created_at"
        code = F("last_error") if "last_error" in table.fields else Value("")
        job_type = F(table.job_type_field) if table.job_type_field else Value(table.job_type)
        aggregates = {
            name: Count("pk", filter=Q(**{f"{time}__gte": clock - window}))
            for name, window in WINDOWS
        }
        # The plugin's row type knows the g_ keys, not the per-window counts annotated by name.
        rows: Iterable[Mapping[str, Any]] = (
            table.model._default_manager.filter(
                state=RunState.FAILED, **{f"{time}__gte": clock - longest}
            )
            .annotate(g_code=code, g_type=job_type)
            .values("g_code", "g_type")
            .annotate(**aggregates, g_first=Min(time), g_last=Max(time))
            .order_by()
        )
        for row in rows:
            counts = {name: row[name] for name, _window in WINDOWS}
            key = (table.label, row["g_code"] or "")
            by_cause.setdefault(key, Group(*key)).add(counts, row["g_first"], row["g_last"])
            key = (table.label, row["g_type"] or "")
            by_type.setdefault(key, Group(*key)).add(counts, row["g_first"], row["g_last"])
    return _ranked(by_cause), _ranked(by_type)


def _ranked(groups: dict[tuple[str, str], Group]) -> list[Group]:
    """Most recent trouble first: by the last hour, then the day, then the week."""
    return sorted(
        groups.values(),
        key=lambda g: (*(-g.counts.get(n, 0) for n, _w in WINDOWS), g.module, g.key),
    )
