"""Cron slots on a schedule's wall clock, daylight-saving rules, and misfire plans. No I/O.

A cron expression is read on the local wall clock of the schedule's time zone; its slots are
returned as UTC instants. Two rules make each wall-clock slot fire at most once:

* **fall back** (a wall-clock hour repeats): a slot fires at its first occurrence only;
* **spring forward** (a wall-clock hour is skipped): a slot inside the gap fires once, at the
  instant the clock jumps (``30 2 * * *`` fires at 03:00 on the day that skips 02:00-03:00),
  and several gap slots that land on one instant fire once.

Mapping wall-clock times to instants this way never goes backwards, so slots come out sorted
in both directions and a duplicate can only follow its twin.

A *misfire* is a slot more than the grace late: no scheduler was leading when it was due. The
plan for one tick turns the slots between the last recorded slot and ``now`` into decisions::

    slot ≤ last recorded                      nothing (recorded already, by anyone)
    now - grace < slot ≤ now                  on_time   (fires)
    slot ≤ now - grace, misfire "skip"        the latest is recorded as skipped (no job)
    slot ≤ now - grace, misfire "once"        the latest fires as one catch_up for all of them
    slot ≤ now - grace, misfire "all"         the latest max_catch_up fire as catch_up, oldest
                                              first; older ones are recorded as one skipped row

A schedule that has never recorded a slot has no history to catch up on: its first tick fires
only its current slot (the latest within the grace), not every slot the grace still covers (an
every-second schedule would start with 60 jobs). Given ``start`` (the schedule's
``catch_up_from``), a new schedule plans as if it had recorded everything before ``start``:
every slot from there is on time or missed as above.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import croniter
from django.db import models
from django.utils.translation import gettext_lazy as _

from jobs.models.schedules import SlotKind


class Misfire(models.TextChoices):
    """What to do with slots missed while no scheduler ran."""

    SKIP = "skip", _("Skip missed slots")
    ONCE = "once", _("One catch-up run")
    ALL = "all", _("Every missed slot, up to a bound")


@dataclass(frozen=True, slots=True)
class Decision:
    """One slot to record. ``missed_from`` is the first missed slot this one stands for."""

    slot: datetime
    kind: str
    missed_from: datetime | None = None

    @property
    def fires(self) -> bool:
        return self.kind != SlotKind.SKIPPED


def check_expression(expression: object) -> str | None:
    """Why ``expression`` is not a usable cron expression, or None when it is."""
    if not isinstance(expression, str) or not expression.strip():
        return f"cron must be a non-empty string, got {expression!r}"
    fields = expression.split()
    if not expression.startswith("@") and len(fields) not in (5, 6):
        return (
            f"cron {expression!r} has {len(fields)} fields; use 5 (minute hour day month "
            f"weekday) or 6 (the same plus seconds at the end)"
        )
    if not croniter.is_valid(expression):
        return f"cron {expression!r} is not a valid cron expression"
    try:
        croniter(expression, datetime(2000, 1, 1)).get_next(datetime)
    except Exception:  # CroniterBadDateError and friends: no matching date at all
        return f"cron {expression!r} never fires"
    return None


def wall_clock(instant: datetime, tz: ZoneInfo) -> datetime:
    """The naive local time that ``instant`` shows in ``tz``."""
    return instant.astimezone(tz).replace(tzinfo=None)


def resolve(wall: datetime, tz: ZoneInfo) -> datetime:
    """The UTC instant a wall-clock slot fires at (see the module's DST rules)."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if wall_clock(first, tz) == wall:
        return first  # exists; if it repeats, fold=0 is its first occurrence
    # In a gap: fold=1 reads it with the offset before the jump (an instant before the jump),
    # fold=0 with the offset after (an instant after it). Find the jump between the two.
    low = int(wall.replace(tzinfo=tz, fold=1).astimezone(UTC).timestamp())
    high = int(first.timestamp())
    after = first.astimezone(tz).utcoffset()
    while high - low > 1:
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, tz).utcoffset() == after:
            high = middle
        else:
            low = middle
    return datetime.fromtimestamp(high, UTC)


def slots_after(expression: str, tz: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """Slots strictly after the instant ``after``, earliest first (an endless iterator)."""
    wall = croniter(expression, wall_clock(after, tz))
    previous = after
    while True:
        instant = resolve(wall.get_next(datetime), tz)
        if instant > previous:
            previous = instant
            yield instant


def slots_until(expression: str, tz: ZoneInfo, until: datetime) -> Iterator[datetime]:
    """Slots at or before the instant ``until``, latest first (an endless iterator)."""
    local = until.astimezone(tz)
    wall = local.replace(tzinfo=None, microsecond=0)
    # In the second pass of a repeated hour, the wall times just after this one still resolve
    # to their first pass, before ``until``: start the walk back from the end of that hour.
    resolved_offset, offset = resolve(wall, tz).astimezone(tz).utcoffset(), local.utcoffset()
    assert resolved_offset is not None and offset is not None  # aware, in a ZoneInfo
    shift = resolved_offset - offset
    walk = croniter(expression, wall + max(shift, timedelta(0)) + timedelta(seconds=1))
    previous: datetime | None = None
    while True:
        instant = resolve(walk.get_prev(datetime), tz)
        if instant <= until and (previous is None or instant < previous):
            previous = instant
            yield instant


def next_slot(expression: str, tz: ZoneInfo, after: datetime) -> datetime:
    """The first slot strictly after ``after``."""
    return next(slots_after(expression, tz, after))


def first_due(
    expression: str, tz: ZoneInfo, *, now: datetime, grace: timedelta, start: datetime | None
) -> datetime:
    """The slot a schedule that has recorded nothing fires first (see :func:`plan`)."""
    if start is not None:
        return next_slot(expression, tz, start.astimezone(UTC) - timedelta(microseconds=1))
    current = next(slots_until(expression, tz, now))
    return current if current > now - grace else next_slot(expression, tz, now)


def plan(
    expression: str,
    tz: ZoneInfo,
    *,
    now: datetime,
    last: datetime | None,
    grace: timedelta,
    misfire: str,
    max_catch_up: int,
    start: datetime | None = None,
) -> list[Decision]:
    """The slots to record at ``now``, given the last slot recorded; earliest first.

    Walks back from ``now`` and stops at ``last`` or once the policy has what it needs, so a
    long downtime costs no more than ``max_catch_up`` steps.
    """
    if last is None and start is not None:
        # A slot at ``start`` itself is due. In UTC: aware arithmetic on a zone's wall clock
        # would step back into a daylight-saving gap, an hour away.
        last = start.astimezone(UTC) - timedelta(microseconds=1)
    wanted = max_catch_up + 1 if misfire == Misfire.ALL else 1
    on_time: list[datetime] = []
    missed: list[datetime] = []
    for slot in slots_until(expression, tz, now):
        if last is not None and slot <= last:
            break
        if slot > now - grace:
            on_time.append(slot)
            if last is None:
                break  # never recorded: only the current slot, no history to catch up on
            continue
        if last is None:
            break
        missed.append(slot)
        if len(missed) >= wanted:
            break
    on_time.reverse()
    missed.reverse()
    decisions: list[Decision] = []
    if missed:
        assert last is not None
        first_missed = next_slot(expression, tz, last)
        if misfire == Misfire.SKIP:
            decisions.append(Decision(missed[-1], SlotKind.SKIPPED, first_missed))
        elif misfire == Misfire.ONCE:
            decisions.append(Decision(missed[-1], SlotKind.CATCH_UP, first_missed))
        else:
            if len(missed) > max_catch_up:
                dropped, missed = missed[0], missed[1:]
                decisions.append(Decision(dropped, SlotKind.SKIPPED, first_missed))
            decisions.extend(Decision(slot, SlotKind.CATCH_UP) for slot in missed)
    decisions.extend(Decision(slot, SlotKind.ON_TIME) for slot in on_time)
    return decisions


def skipped_while_paused(
    expression: str, tz: ZoneInfo, *, last: datetime | None, since: datetime, now: datetime
) -> Decision | None:
    """The one skipped row standing for the slots a paused schedule let pass, or None.

    Those are the slots after ``last`` (the latest recorded; without one, from ``since``, when
    the pause began) up to ``now``. Recording them when the schedule resumes keeps the next
    tick from firing them as catch-ups: a resume is not a burst.
    """
    after = last if last is not None else since.astimezone(UTC) - timedelta(microseconds=1)
    first = next_slot(expression, tz, after)
    if first > now:
        return None
    return Decision(next(slots_until(expression, tz, now)), SlotKind.SKIPPED, first)
