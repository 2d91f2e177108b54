"""The history's time partitions: named by their bounds, planned without overlaps, and made
under lock waits short enough that no writer of the history notices them.

``jobs_jobhistory`` is partitioned by state, then each state's table by ``finished_at``; this
module knows the second level. A partition's name carries its bounds in UTC
(``jobs_jobhistory_failed_2026120100_2026120200``), so the layout is read from the catalog by
name alone. :mod:`jobs.queue.history` decides what to create and drop, and when.

Locks. Once the worker's pass writes finished rows into the history, writes arrive all the
time, and DDL meets them:

    statement                             lock on the state's table   writers of that state
    ────────────────────────────────────  ──────────────────────────  ─────────────────────
    CREATE TABLE … (LIKE jobs_jobhistory)  none (ACCESS SHARE on        never wait
                                            jobs_jobhistory, as a read)
    ALTER TABLE … ATTACH PARTITION         SHARE UPDATE EXCLUSIVE       never wait
    DROP TABLE <partition>                 ACCESS EXCLUSIVE             wait while it waits

A DDL statement waits for the locks it needs, and every later request that conflicts with it
waits behind it, so each runs inside :func:`ddl`: its waits are cut to
:data:`DDL_LOCK_TIMEOUT`, and a statement that met the timeout leaves its work to the next pass.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from jobs.runs import TERMINAL_STATES

PARENT = "jobs_jobhistory"
HOUR, DAY = timedelta(hours=1), timedelta(days=1)
#: The longest any DDL statement on the history waits for a lock before its work is left for
#: the next pass. While a DROP TABLE waits, every new write of that state's history rows waits
#: behind it (PostgreSQL queues a request behind the conflicting ones that wait before it),
#: and the worker's pass writes there. A tenth of a second is enough to get past the writes
#: in flight, and short enough that no writer waits noticeably.
DDL_LOCK_TIMEOUT = timedelta(milliseconds=100)
# pg_advisory_xact_lock key of the history's DDL ("jobs" history, as a 63-bit constant).
_DDL_LOCK = 0x6A6F62735F68
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
    """Create and attach what :func:`plan` finds missing; the new partitions. Inside :func:`ddl`.

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


@contextmanager
def ddl(cur: CursorWrapper) -> Iterator[None]:
    """A transaction for DDL on the history: one at a time, and short lock waits.

    The advisory lock makes callers take turns, so none attaches what another just did, and
    no drop comes between reading the layout and recording what it covers. Then every lock
    wait is cut to :data:`DDL_LOCK_TIMEOUT`; one that runs out raises (SQLSTATE 55P03) and
    the transaction rolls back. ``SET LOCAL`` inside a caller's transaction would last until
    that transaction ends, so the caller's own value is put back at the end.
    """
    outer = cur.db.in_atomic_block or not cur.db.get_autocommit()
    with transaction.atomic(using=cur.db.alias):
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [_DDL_LOCK])
        previous = None
        if outer:
            cur.execute("SELECT current_setting('lock_timeout')")
            (previous,) = cur.fetchone()
        cur.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT // timedelta(milliseconds=1)}ms'")
        yield
        if previous is not None:
            cur.execute("SELECT set_config('lock_timeout', %s, true)", [previous])


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
