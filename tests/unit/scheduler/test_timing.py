"""Slot computation across daylight-saving changes, and the misfire plans. No database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import islice, takewhile
from zoneinfo import ZoneInfo

import pytest

from jobs.catalogue.timing import (
    Decision,
    SlotKind,
    check_expression,
    next_slot,
    plan,
    slots_after,
    slots_until,
)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")  # shifts by 30 minutes


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def between(expression: str, tz: ZoneInfo, start: datetime, end: datetime) -> list[datetime]:
    return list(takewhile(lambda s: s <= end, slots_after(expression, tz, start)))


def local(slots: list[datetime], tz: ZoneInfo) -> list[str]:
    return [s.astimezone(tz).strftime("%d %H:%M%z") for s in slots]


# Berlin: 2024-03-31 02:00 CET jumps to 03:00 CEST (01:00 UTC); 2024-10-27 03:00 CEST falls
# back to 02:00 CET (01:00 UTC), so 02:00-02:59 happens twice.
SPRING = (utc(2024, 3, 30, 23), utc(2024, 3, 31, 3))
FALL = (utc(2024, 10, 26, 22), utc(2024, 10, 27, 3))


class TestDaylightSaving:
    def test_a_daily_slot_in_the_spring_gap_fires_once_when_the_clock_jumps(self):
        slots = between("30 2 * * *", BERLIN, utc(2024, 3, 29, 12), utc(2024, 4, 1, 12))
        assert local(slots, BERLIN) == ["30 02:30+0100", "31 03:00+0200", "01 02:30+0200"]

    def test_gap_slots_that_land_on_one_instant_fire_once(self):
        slots = between("15,45 1-3 * * *", BERLIN, *SPRING)
        assert local(slots, BERLIN) == [
            "31 01:15+0100",
            "31 01:45+0100",
            "31 03:00+0200",  # stands for 02:15 and 02:45, which do not exist
            "31 03:15+0200",
            "31 03:45+0200",
        ]

    def test_every_half_hour_across_spring_forward(self):
        slots = between("*/30 * * * *", BERLIN, *SPRING)
        assert local(slots, BERLIN)[1:5] == [
            "31 01:00+0100",
            "31 01:30+0100",
            "31 03:00+0200",
            "31 03:30+0200",
        ]

    def test_a_repeated_wall_clock_slot_fires_at_its_first_occurrence_only(self):
        slots = between("30 2 * * *", BERLIN, utc(2024, 10, 25, 12), utc(2024, 10, 28, 12))
        assert local(slots, BERLIN) == ["26 02:30+0200", "27 02:30+0200", "28 02:30+0100"]

    def test_the_repeated_hour_fires_once(self):
        slots = between("*/30 * * * *", BERLIN, *FALL)
        assert local(slots, BERLIN)[-5:] == [
            "27 02:00+0200",
            "27 02:30+0200",
            "27 03:00+0100",  # 02:00 and 02:30 CET are wall-clock repeats: skipped
            "27 03:30+0100",
            "27 04:00+0100",
        ]
        assert len(set(s.astimezone(BERLIN).replace(tzinfo=None) for s in slots)) == len(slots)

    def test_the_repeated_hour_fires_once_in_new_york_too(self):
        slots = between("0 * * * *", NEW_YORK, utc(2024, 11, 3, 3), utc(2024, 11, 3, 9))
        assert local(slots, NEW_YORK) == [
            "03 00:00-0400",
            "03 01:00-0400",  # 01:00-0500 is the same wall-clock time again
            "03 02:00-0500",
            "03 03:00-0500",
            "03 04:00-0500",
        ]

    def test_a_half_hour_shift(self):
        slots = between("*/20 * * * *", LORD_HOWE, utc(2024, 10, 5, 14), utc(2024, 10, 5, 16))
        assert local(slots, LORD_HOWE) == [
            "06 00:40+1030",
            "06 01:00+1030",
            "06 01:20+1030",
            "06 01:40+1030",
            "06 02:30+1100",  # 02:00 and 02:20 do not exist: both fire when the clock jumps
            "06 02:40+1100",
            "06 03:00+1100",
        ]

    @pytest.mark.parametrize(
        ("expression", "tz", "window"),
        [
            ("*/30 * * * *", BERLIN, SPRING),
            ("*/30 * * * *", BERLIN, FALL),
            ("30 2 * * *", BERLIN, (utc(2024, 3, 25), utc(2024, 4, 5))),
            ("30 2 * * *", BERLIN, (utc(2024, 10, 20), utc(2024, 11, 5))),
            ("15,45 1-3 * * *", BERLIN, SPRING),
            ("0 * * * *", NEW_YORK, (utc(2024, 3, 10, 4), utc(2024, 3, 10, 10))),
            ("*/7 * * * *", NEW_YORK, (utc(2024, 11, 3, 4), utc(2024, 11, 3, 8))),
            ("*/20 * * * *", LORD_HOWE, (utc(2024, 4, 6, 14), utc(2024, 4, 6, 17))),
            ("* * * * * *", BERLIN, (utc(2024, 10, 27, 0, 59, 50), utc(2024, 10, 27, 1, 0, 10))),
        ],
    )
    def test_walking_back_gives_the_same_slots(self, expression, tz, window):
        start, end = window
        forward = between(expression, tz, start, end)
        backward = list(takewhile(lambda s: s > start, slots_until(expression, tz, end)))
        assert backward == forward[::-1]
        assert forward == sorted(set(forward))

    def test_walking_back_from_inside_the_repeated_hour(self):
        # 02:10 CET, the second pass: 02:30 CEST (00:30 UTC) is already behind us.
        until = utc(2024, 10, 27, 1, 10)
        got = list(islice(slots_until("*/30 * * * *", BERLIN, until), 3))
        assert got == [utc(2024, 10, 27, 0, 30), utc(2024, 10, 27, 0, 0), utc(2024, 10, 26, 23, 30)]
        assert next_slot("*/30 * * * *", BERLIN, until) == utc(2024, 10, 27, 2)

    def test_a_slot_exactly_at_the_bounds(self):
        at = utc(2024, 1, 1, 11)
        assert next(slots_until("0 * * * *", BERLIN, at)) == at
        assert next_slot("0 * * * *", BERLIN, at) == utc(2024, 1, 1, 12)
        assert next(slots_until("0 * * * *", BERLIN, at - timedelta(microseconds=1))) == utc(
            2024, 1, 1, 10
        )


class TestExpressions:
    @pytest.mark.parametrize(
        "expression", ["0 3 * * *", "*/5 * * * 1-5", "* * * * * */10", "@daily"]
    )
    def test_valid(self, expression):
        assert check_expression(expression) is None

    @pytest.mark.parametrize(
        ("expression", "problem"),
        [
            ("61 * * * *", "cron '61 * * * *' is not a valid cron expression"),
            (
                "* * *",
                "cron '* * *' has 3 fields; use 5 (minute hour day month weekday) or 6 "
                "(the same plus seconds at the end)",
            ),
            ("0 0 30 2 *", "cron '0 0 30 2 *' never fires"),
            ("", "cron must be a non-empty string, got ''"),
            (None, "cron must be a non-empty string, got None"),
        ],
    )
    def test_invalid(self, expression, problem):
        assert check_expression(expression) == problem


HOURLY = "0 * * * *"
GRACE = timedelta(seconds=60)


def hourly_plan(now: datetime, last: datetime | None, misfire: str, max_catch_up: int = 10):
    return plan(
        HOURLY,
        ZoneInfo("UTC"),
        now=now,
        last=last,
        grace=GRACE,
        misfire=misfire,
        max_catch_up=max_catch_up,
    )


class TestMisfirePlans:
    """The scheduler fired 10:00, was down, and ticks again at 15:00:05."""

    last = utc(2024, 5, 1, 10)
    now = utc(2024, 5, 1, 15, 0, 5)

    @pytest.mark.parametrize("misfire", ["skip", "once", "all"])
    def test_a_slot_within_the_grace_is_on_time_whatever_the_policy(self, misfire):
        now = utc(2024, 5, 1, 11, 0, 59)
        assert hourly_plan(now, self.last, misfire) == [
            Decision(utc(2024, 5, 1, 11), SlotKind.ON_TIME)
        ]

    def test_a_slot_past_the_grace_is_missed(self):
        now = utc(2024, 5, 1, 11, 1)
        assert hourly_plan(now, self.last, "skip") == [
            Decision(utc(2024, 5, 1, 11), SlotKind.SKIPPED, utc(2024, 5, 1, 11))
        ]

    def test_skip_records_the_missed_slots_as_one_skipped_row_and_fires_only_the_current(self):
        assert hourly_plan(self.now, self.last, "skip") == [
            Decision(utc(2024, 5, 1, 14), SlotKind.SKIPPED, utc(2024, 5, 1, 11)),
            Decision(utc(2024, 5, 1, 15), SlotKind.ON_TIME),
        ]

    def test_once_fires_one_catch_up_for_all_missed_slots(self):
        assert hourly_plan(self.now, self.last, "once") == [
            Decision(utc(2024, 5, 1, 14), SlotKind.CATCH_UP, utc(2024, 5, 1, 11)),
            Decision(utc(2024, 5, 1, 15), SlotKind.ON_TIME),
        ]

    def test_all_fires_every_missed_slot_oldest_first(self):
        assert hourly_plan(self.now, self.last, "all") == [
            Decision(utc(2024, 5, 1, 11), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 12), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 13), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 14), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 15), SlotKind.ON_TIME),
        ]

    def test_all_is_bounded_and_records_what_it_dropped(self):
        assert hourly_plan(self.now, self.last, "all", max_catch_up=2) == [
            Decision(utc(2024, 5, 1, 12), SlotKind.SKIPPED, utc(2024, 5, 1, 11)),
            Decision(utc(2024, 5, 1, 13), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 14), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 15), SlotKind.ON_TIME),
        ]

    def test_a_year_of_downtime_costs_only_the_bound(self):
        now = self.now + timedelta(days=365)
        decisions = plan(
            "* * * * * *",
            ZoneInfo("UTC"),
            now=now,
            last=self.last,
            grace=GRACE,
            misfire="all",
            max_catch_up=3,
        )
        assert [d.kind for d in decisions[:4]] == ["skipped", "catch_up", "catch_up", "catch_up"]
        assert decisions[0].missed_from == self.last + timedelta(seconds=1)
        assert len(decisions) == 4 + 60  # and the on-time slots inside the grace

    def test_a_schedule_never_recorded_has_nothing_to_catch_up(self):
        assert hourly_plan(self.now, None, "all") == [
            Decision(utc(2024, 5, 1, 15), SlotKind.ON_TIME)
        ]
        assert hourly_plan(utc(2024, 5, 1, 15, 30), None, "all") == []

    def test_nothing_is_due_twice(self):
        assert hourly_plan(self.now, utc(2024, 5, 1, 15), "all") == []

    def test_a_clock_that_jumps_back_fires_nothing_until_it_passes_the_last_slot(self):
        assert hourly_plan(utc(2024, 5, 1, 9, 0, 5), self.last, "all") == []
        assert hourly_plan(utc(2024, 5, 1, 10, 0, 5), self.last, "all") == []


EVERY_SECOND = "* * * * * *"


class TestFirstTick:
    """A schedule that has recorded nothing yet: what its first tick fires."""

    now = utc(2024, 5, 1, 10, 0, 59, 500000)

    def first_plan(self, misfire="skip", start=None, expression=EVERY_SECOND):
        return plan(
            expression,
            ZoneInfo("UTC"),
            now=self.now,
            last=None,
            grace=GRACE,
            misfire=misfire,
            max_catch_up=10,
            start=start,
        )

    @pytest.mark.parametrize("misfire", ["skip", "once", "all"])
    def test_only_the_current_slot_fires_whatever_the_grace_still_covers(self, misfire):
        assert self.first_plan(misfire) == [Decision(utc(2024, 5, 1, 10, 0, 59), SlotKind.ON_TIME)]

    def test_a_current_slot_past_the_grace_does_not_fire(self):
        # 10:00 is 59.5 s old at 10:00:59.5: inside the grace, it fires; at 10:01:01 it is not.
        assert self.first_plan(expression=HOURLY) == [
            Decision(utc(2024, 5, 1, 10), SlotKind.ON_TIME)
        ]
        late = utc(2024, 5, 1, 10, 1, 1)
        assert (
            plan(
                HOURLY,
                ZoneInfo("UTC"),
                now=late,
                last=None,
                grace=GRACE,
                misfire="all",
                max_catch_up=10,
            )
            == []
        )

    def test_catch_up_from_makes_every_slot_since_then_due(self):
        start = utc(2024, 5, 1, 10, 0, 55)
        assert self.first_plan(start=start) == [
            Decision(utc(2024, 5, 1, 10, 0, second), SlotKind.ON_TIME) for second in range(55, 60)
        ]

    def test_catch_up_from_hands_the_missed_slots_to_the_misfire_policy(self):
        start = utc(2024, 5, 1, 7)
        now = utc(2024, 5, 1, 10, 0, 5)

        def first(misfire):
            return plan(
                HOURLY,
                ZoneInfo("UTC"),
                now=now,
                last=None,
                grace=GRACE,
                misfire=misfire,
                max_catch_up=10,
                start=start,
            )

        assert first("once") == [
            Decision(utc(2024, 5, 1, 9), SlotKind.CATCH_UP, utc(2024, 5, 1, 7)),
            Decision(utc(2024, 5, 1, 10), SlotKind.ON_TIME),
        ]
        assert first("all") == [
            Decision(utc(2024, 5, 1, 7), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 8), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 9), SlotKind.CATCH_UP),
            Decision(utc(2024, 5, 1, 10), SlotKind.ON_TIME),
        ]

    def test_catch_up_from_in_the_future_fires_nothing_before_it(self):
        assert self.first_plan(start=utc(2024, 5, 1, 11)) == []
