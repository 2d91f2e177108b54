"""The history's time partitions: named by their bounds, planned without overlaps, and made.

``jobs_jobhistory`` is partitioned by state, then each state's table by ``finished_at``; this
module knows the second level. A partition's name carries its bounds in UTC
(``jobs_jobhistory_failed_2026120100_2026120200``), so the layout is read from the catalog by
name alone. :mod:`jobs.queue.history` decides what to create and drop, and when.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from jobs.runs import TERMINAL_STATES

PARENT = "jobs_jobhistory"
HOUR, DAY = timedelta(hours=1), timedelta(days=1)
_STAMP = "%Y%m%d%H"
_NAME = re.compile(rf"^{PARENT}_(?P<state>[a-z]+)_(?P<start>\d{{10}})_(?P<end>\d{{10}})$")


@dataclass(frozen=True)
class Partition:
    """One time partition of one state's history: rows finished in ``[start, end)``."""

    state: str
    start: datetime
    end: datetime

    @property
    def name(self) -> str:
        return f"{PARENT}_{self.state}_{self.start:{_STAMP}}_{self.end:{_STAMP}}"

    @classmethod
    def parse(cls, name: str) -> Partition | None:
        match = _NAME.match(name)
        if match is None or match["state"] not in TERMINAL_STATES:
            return None
        start, end = (
            datetime.strptime(match[key], _STAMP).replace(tzinfo=UTC) for key in ("start", "end")
        )
        return cls(match["state"], start, end)


def partitions(cur: CursorWrapper, state: str) -> list[Partition]:
    """The time partitions of ``state``'s history, oldest first (read from the catalog)."""
    cur.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = %s::regclass",
        [f"{PARENT}_{state}"],
    )
    return parsed(name for (name,) in cur.fetchall())


def parsed(names: Iterable[str]) -> list[Partition]:
    """The time partitions among ``names``, oldest first."""
    found = (Partition.parse(name) for name in names)
    return sorted((p for p in found if p is not None), key=lambda p: p.start)


def plan(
    existing: list[Partition], state: str, first: datetime, last: datetime, span: timedelta
) -> list[Partition]:
    """The partitions to add so every hour from ``first`` to ``last`` has one.

    Each uncovered hour gets the partition of its bucket (``span``: an hour or a day), cut
    short where an existing partition, made under another width, covers part of the bucket.
    """
    taken = list(existing)
    added: list[Partition] = []
    hour = floor(first, HOUR)
    while hour <= last:
        if not any(p.start <= hour < p.end for p in taken):
            bucket = floor(hour, span)
            start = max([bucket, *(p.end for p in taken if p.end <= hour)])
            end = min([bucket + span, *(p.start for p in taken if p.start > hour)])
            added.append(Partition(state, start, end))
            taken.append(added[-1])
        hour += HOUR
    return added


def create(
    cur: CursorWrapper, state: str, first: datetime, last: datetime, span: timedelta
) -> list[Partition]:
    """Create and attach what :func:`plan` finds missing; the new partitions.

    Each is created on its own and then attached, so neither readers nor writers of the
    history wait on it (``CREATE TABLE … PARTITION OF`` would take ACCESS EXCLUSIVE on the
    state's table). ATTACH's SHARE UPDATE EXCLUSIVE, on the state's table and its indexes,
    conflicts only with other DDL, VACUUM or ANALYZE of them.
    """
    created = plan(partitions(cur, state), state, first, last, span)
    for partition in created:
        cur.execute(f"CREATE TABLE {partition.name} (LIKE {PARENT} INCLUDING DEFAULTS)")
        cur.execute(
            f"ALTER TABLE {PARENT}_{state} ATTACH PARTITION {partition.name} "
            "FOR VALUES FROM (%s) TO (%s)",
            [partition.start, partition.end],
        )
    return created


def utc(moment: datetime) -> datetime:
    """Aware UTC. With ``USE_TZ = False`` Django hands back naive times in ``TIME_ZONE``."""
    if timezone.is_naive(moment):
        moment = timezone.make_aware(moment, timezone.get_default_timezone())
    return moment.astimezone(UTC)


def floor(moment: datetime, span: timedelta) -> datetime:
    """The start of the UTC hour or day ``moment`` falls in."""
    moment = moment.astimezone(UTC)
    if span == DAY:
        return moment.replace(hour=0, minute=0, second=0, microsecond=0)
    return moment.replace(minute=0, second=0, microsecond=0)
