"""Every SQL statement on the recorded-slots table (``jobs_scheduleslot``) lives here.

A slot row is written once, in the transaction that enqueues the slot's job. The table's
``UNIQUE (schedule, slot)`` makes "at most one job per slot" the database's decision: a second
scheduler, a replay of a tick after a crash or a clock jump inserts nothing and so enqueues
nothing. Functions take a cursor so they run inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db.backends.utils import CursorWrapper

from jobs.catalogue.timing import Decision
from jobs.models import SlotKind

# The jobs_pause kind of a paused schedule: jobs.models.PauseKind.SCHEDULE, spelled out so
# that this module stays importable without the models (as jobs.catalogue.timing is).
PAUSED_KIND = "schedule"
# The first key of pg_advisory_xact_lock(int, int) for per-schedule tick locks ("jobs").
TICK_LOCK_NAMESPACE = 0x6A6F6273


@dataclass(frozen=True, slots=True)
class SlotSummary:
    """The latest recorded slots of one schedule (None where there is none)."""

    last_slot: datetime | None = None
    last_fired_slot: datetime | None = None
    last_fired_at: datetime | None = None
    last_job_id: str = ""
    last_skipped_slot: datetime | None = None
    last_job_pk: int | None = None  # the jobs row the latest fired slot enqueued
    paused: bool = False  # a pause of the schedule is in the pauses table


def lock_schedule(cur: CursorWrapper, name: str) -> None:
    """Serialize ticks of one schedule until the transaction ends.

    Uniqueness alone already keeps a slot from firing twice; the lock makes a second scheduler
    read the first one's slots before planning, so both apply one misfire decision.
    """
    cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [TICK_LOCK_NAMESPACE, name])


def last_recorded(cur: CursorWrapper, name: str) -> datetime | None:
    """The latest slot recorded for this schedule, fired or skipped."""
    cur.execute("SELECT max(slot) FROM jobs_scheduleslot WHERE schedule = %s", [name])
    latest: datetime | None = cur.fetchone()[0]
    return latest


def record(
    cur: CursorWrapper, name: str, decision: Decision, *, job_id: str, by: str
) -> int | None:
    """Insert the slot unless it is recorded already; the new row's id, or None."""
    cur.execute(
        """
        INSERT INTO jobs_scheduleslot (schedule, slot, kind, missed_from, job_id, recorded_by)
        VALUES (%s, %s, %s, %s, %s, %s)
        ON CONFLICT (schedule, slot) DO NOTHING
        RETURNING id
        """,
        [name, decision.slot, decision.kind, decision.missed_from, job_id, by[:200]],
    )
    row: tuple[int] | None = cur.fetchone()
    return None if row is None else row[0]


def attach_job(cur: CursorWrapper, row_id: int, job_pk: int) -> None:
    """Remember which jobs row a fired slot enqueued (or found holding its job_id)."""
    cur.execute("UPDATE jobs_scheduleslot SET job_pk = %s WHERE id = %s", [job_pk, row_id])


def summaries(cur: CursorWrapper, names: Sequence[str]) -> dict[str, SlotSummary]:
    """The latest recorded, fired and skipped slot of each schedule, and whether it is paused,
    in one statement."""
    cur.execute(
        """
        SELECT n.name, latest.slot, fired.slot, fired.recorded_at, fired.job_id, skipped.slot,
               fired.job_pk,
               EXISTS (SELECT 1 FROM jobs_pause p
                       WHERE p.kind = %(paused)s AND p.value = n.name) AS paused
        FROM unnest(%(names)s::text[]) AS n(name)
        LEFT JOIN LATERAL (
            SELECT s.slot FROM jobs_scheduleslot s WHERE s.schedule = n.name
            ORDER BY s.slot DESC LIMIT 1
        ) latest ON TRUE
        LEFT JOIN LATERAL (
            SELECT s.slot, s.recorded_at, s.job_id, s.job_pk FROM jobs_scheduleslot s
            WHERE s.schedule = n.name AND s.kind <> %(skipped)s
            ORDER BY s.slot DESC LIMIT 1
        ) fired ON TRUE
        LEFT JOIN LATERAL (
            SELECT s.slot FROM jobs_scheduleslot s
            WHERE s.schedule = n.name AND s.kind = %(skipped)s
            ORDER BY s.slot DESC LIMIT 1
        ) skipped ON TRUE
        """,
        {"names": list(names), "skipped": SlotKind.SKIPPED, "paused": PAUSED_KIND},
    )
    return {
        name: SlotSummary(last, fired, fired_at, job_id or "", skipped, job_pk, paused)
        for name, last, fired, fired_at, job_id, skipped, job_pk, paused in cur.fetchall()
    }


@dataclass(frozen=True, slots=True)
class SlotRow:
    """One recorded slot, as the schedules page lists it."""

    schedule: str
    slot: datetime
    kind: str
    missed_from: datetime | None
    job_id: str
    job_pk: int | None
    recorded_at: datetime
    recorded_by: str


def recent(cur: CursorWrapper, names: Sequence[str], *, limit: int) -> list[SlotRow]:
    """The latest ``limit`` slots recorded for these schedules, newest first (one statement,
    down the ``(schedule, slot)`` unique index of each)."""
    cur.execute(
        """
        SELECT r.schedule, r.slot, r.kind, r.missed_from, r.job_id, r.job_pk,
               r.recorded_at, r.recorded_by
        FROM unnest(%(names)s::text[]) AS n(name)
        CROSS JOIN LATERAL (
            SELECT s.* FROM jobs_scheduleslot s WHERE s.schedule = n.name
            ORDER BY s.slot DESC LIMIT %(limit)s
        ) r
        ORDER BY r.slot DESC, r.schedule
        LIMIT %(limit)s
        """,
        {"names": list(names), "limit": limit},
    )
    return [SlotRow(*row) for row in cur.fetchall()]


def prune(cur: CursorWrapper, *, before: datetime, batch_size: int) -> int:
    """Delete one batch of slots older than ``before``, never a schedule's latest slot.

    The latest slot is where the next tick starts counting missed slots, so it must stay.
    """
    cur.execute(
        """
        DELETE FROM jobs_scheduleslot WHERE id IN (
            SELECT s.id FROM jobs_scheduleslot s
            WHERE s.slot < %(before)s
              AND s.slot < (SELECT max(l.slot) FROM jobs_scheduleslot l
                            WHERE l.schedule = s.schedule)
            ORDER BY s.slot
            LIMIT %(batch)s
            FOR UPDATE SKIP LOCKED
        )
        """,
        {"before": before, "batch": batch_size},
    )
    deleted: int = cur.rowcount
    return deleted
