"""The cron duty against real PostgreSQL: slots, misfire policies, and one job per slot."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client import REGISTRY

import jobs.api.producer
from jobs import enqueue
from jobs.catalogue.registry import get_registry
from jobs.catalogue.schedules import Schedule, load_schedules
from jobs.catalogue.timing import Decision
from jobs.models import Job, ScheduleSlot, SlotKind
from jobs.scheduler.cron import CronService
from jobs.scheduler.leader import LeadershipLost
from jobs.scheduler.reporting import export, status
from tests.jobapp.jobs import PingV1

pytestmark = pytest.mark.django_db

HOURLY = {"cron": "0 * * * *", "job": "jobapp.ping.v1", "payload": {"message": "tick"}}
T = datetime(2030, 5, 1, 10, tzinfo=UTC)


def at(hours: float = 0, seconds: float = 0) -> datetime:
    return T + timedelta(hours=hours, seconds=seconds)


def make(name: str = "hourly", **options) -> Schedule:
    (schedule,) = load_schedules({name: {**HOURLY, **options}}, [], get_registry())
    return schedule


def rows(name: str = "hourly") -> list[tuple]:
    return list(
        ScheduleSlot.objects.filter(schedule=name)
        .order_by("slot")
        .values_list("slot", "kind", "missed_from")
    )


class TestFiring:
    def test_an_on_time_slot_enqueues_its_job_and_records_the_slot_with_it(self):
        schedule = make(tenant="acme")
        counts = CronService([schedule], identity="test-1").run_once(at(seconds=5))
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 0, 0)

        job = Job.objects.get()
        assert (job.job_id, job.name, job.payload, job.tenant, job.state) == (
            "cron:hourly:2030-05-01T10:00:00Z",
            "jobapp.ping.v1",
            {"message": "tick"},
            "acme",
            "queued",
        )
        assert job.queue == "pings"  # the type's policy applies, as for any producer
        slot = ScheduleSlot.objects.get()
        assert (slot.slot, slot.kind, slot.job_id, slot.job_pk, slot.recorded_by) == (
            T,
            "on_time",
            job.job_id,
            job.pk,
            "test-1",
        )

    def test_ticking_again_fires_nothing_more(self):
        service = CronService([make()], identity="test")
        for seconds in (5, 5, 30, 59):
            service.run_once(at(seconds=seconds))
        assert Job.objects.count() == 1
        service.run_once(at(hours=1, seconds=1))
        assert list(Job.objects.order_by("id").values_list("job_id", flat=True)) == [
            "cron:hourly:2030-05-01T10:00:00Z",
            "cron:hourly:2030-05-01T11:00:00Z",
        ]

    def test_a_new_every_second_schedule_starts_with_one_job_not_a_grace_full(self):
        service = CronService([make("fast", cron="* * * * * *")], identity="test")
        counts = service.run_once(at(seconds=59.5))
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 0, 0)
        assert list(Job.objects.values_list("job_id", flat=True)) == [
            "cron:fast:2030-05-01T10:00:59Z"
        ]
        service.run_once(at(seconds=61.2))  # and from then on, every slot
        assert Job.objects.count() == 3

    def test_catch_up_from_fires_what_a_new_schedule_missed_as_its_policy_says(self):
        schedule = make(misfire="all", catch_up_from=at(hours=-3))
        counts = CronService([schedule], identity="test").run_once(at(seconds=5))
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 3, 0)
        assert rows() == [
            (at(-3), "catch_up", None),
            (at(-2), "catch_up", None),
            (at(-1), "catch_up", None),
            (at(0), "on_time", None),
        ]

    def test_a_new_schedule_does_not_fire_slots_older_than_the_grace(self):
        CronService([make()], identity="test").run_once(at(seconds=61))
        assert rows() == []


class TestMisfireAfterDowntime:
    """Fired at 10:00, no scheduler ran until 15:00:05."""

    def tick_through_downtime(self, **options):
        service = CronService([make(**options)], identity="test")
        service.run_once(at(seconds=5))
        return service.run_once(at(hours=5, seconds=5))

    def test_skip_fires_only_the_current_slot_and_records_what_it_skipped(self):
        counts = self.tick_through_downtime(misfire="skip")
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 0, 1)
        assert rows() == [
            (at(0), "on_time", None),
            (at(4), "skipped", at(1)),
            (at(5), "on_time", None),
        ]
        assert Job.objects.count() == 2

    def test_once_fires_one_catch_up_for_all_missed_slots(self):
        counts = self.tick_through_downtime(misfire="once")
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 1, 0)
        assert rows() == [
            (at(0), "on_time", None),
            (at(4), "catch_up", at(1)),
            (at(5), "on_time", None),
        ]
        assert Job.objects.count() == 3

    def test_all_fires_every_missed_slot_up_to_the_bound(self):
        counts = self.tick_through_downtime(misfire="all", max_catch_up=2)
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 2, 1)
        assert rows() == [
            (at(0), "on_time", None),
            (at(2), "skipped", at(1)),
            (at(3), "catch_up", None),
            (at(4), "catch_up", None),
            (at(5), "on_time", None),
        ]
        assert sorted(Job.objects.values_list("job_id", flat=True)) == [
            f"cron:hourly:2030-05-01T{hour}:00:00Z" for hour in (10, 13, 14, 15)
        ]

    def test_after_catching_up_the_schedule_carries_on(self):
        service = CronService([make(misfire="all")], identity="test")
        for now in (at(seconds=5), at(hours=5, seconds=5), at(hours=5, seconds=50)):
            service.run_once(now)
        service.run_once(at(hours=6, seconds=5))
        assert Job.objects.count() == 7  # 10:00 … 16:00, each once


class TestAtMostOneJobPerSlot:
    def test_a_slot_is_never_fired_again_even_after_its_job_failed_and_released_its_key(self):
        schedule = make()
        service = CronService([schedule], identity="test")
        service.run_once(at(seconds=5))
        job = Job.objects.get()
        Job.objects.filter(pk=job.pk).update(
            state="failed", finished_at=timezone.now() - timedelta(days=2), last_error="rejected"
        )

        # A replayed tick (a restart mid-tick, a clock jump) decides the same slot again.
        assert service.record(schedule, [Decision(T, SlotKind.ON_TIME)]) == []
        assert service.run_once(at(seconds=30)).on_time == 0
        assert Job.objects.count() == 1
        # Without the slot table the job_id alone would not have stopped it: the failed job
        # released its key, so an enqueue with the same job_id creates a new job.
        assert enqueue(PingV1(message="tick"), job_id=job.job_id).created

    def test_a_clock_jumping_back_fires_nothing_twice(self):
        service = CronService([make(misfire="all")], identity="test")
        service.run_once(at(hours=1, seconds=5))  # 11:00
        service.run_once(at(hours=-2, seconds=5))  # the clock jumped back two hours
        service.run_once(at(seconds=5))
        service.run_once(at(hours=2, seconds=5))  # 12:00
        assert [slot for slot, _, _ in rows()] == [at(1), at(2)]
        assert Job.objects.count() == 2

    def test_a_tick_that_dies_before_commit_leaves_nothing_and_the_next_tick_fires(
        self, monkeypatch
    ):
        real = jobs.api.producer.enqueue

        def broken(payload, **kwargs):
            if kwargs["job_id"].startswith("cron:broken:"):
                raise RuntimeError("the process died mid-tick")
            return real(payload, **kwargs)

        monkeypatch.setattr(jobs.api.producer, "enqueue", broken)
        service = CronService([make("broken"), make("fine")], identity="test")
        counts = service.run_once(at(seconds=5))
        assert (counts.on_time, counts.errors) == (1, 1)  # one schedule's failure spares the other
        assert rows("broken") == [] and rows("fine") == [(T, "on_time", None)]

        monkeypatch.setattr(jobs.api.producer, "enqueue", real)
        assert service.run_once(at(seconds=10)).on_time == 1
        assert rows("broken") == [(T, "on_time", None)]
        assert Job.objects.count() == 2

    def test_a_tick_that_cannot_prove_leadership_records_nothing(self):
        def fence(using: str) -> None:
            ScheduleSlot.objects.using(using).count()  # inside the tick's transaction
            raise LeadershipLost("lock session gone")

        with pytest.raises(LeadershipLost):
            CronService([make()], identity="test", fence=fence).run_once(at(seconds=5))
        assert rows() == [] and Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)
class TestConcurrentSchedulers:
    def test_schedulers_ticking_the_same_schedule_at_once_fire_each_slot_once(self, threads):
        schedule = make("minutely", cron="* * * * *", misfire="all")
        services = [CronService([schedule], identity=f"scheduler-{i}") for i in range(6)]
        for step in range(8):
            base = at(hours=step * 0.1)  # every 6 minutes: catch-ups and on-time slots
            threads(6, lambda i, base=base: services[i].run_once(base + timedelta(seconds=i)))

        slots = rows("minutely")
        assert len(slots) == len({slot for slot, _, _ in slots})
        job_ids = list(Job.objects.values_list("job_id", flat=True))
        assert len(job_ids) == len(set(job_ids)) == len(slots) == 43  # 10:00 … 10:42

    def test_the_unique_constraint_alone_decides_between_racing_writers(self, threads):
        schedule = make()
        services = [CronService([schedule], identity=f"scheduler-{i}") for i in range(12)]
        decision = Decision(T, SlotKind.ON_TIME)

        results = threads(12, lambda i: services[i].record(schedule, [decision]))

        assert sum(len(fired) for fired in results) == 1
        assert Job.objects.count() == 1 and rows() == [(T, "on_time", None)]


class TestStatus:
    def test_last_fired_next_due_and_overdue(self):
        schedule = make(misfire="skip")
        (before,) = status(now=at(seconds=5), schedules=[schedule])
        assert (before.last_fired_slot, before.next_due, before.overdue) == (None, T, False)

        CronService([schedule], identity="test").run_once(at(seconds=5))
        (fired,) = status(now=at(seconds=6), schedules=[schedule])
        assert (fired.last_fired_slot, fired.last_job_id, fired.next_due) == (
            T,
            "cron:hourly:2030-05-01T10:00:00Z",
            at(1),
        )
        assert fired.last_fired_at is not None and not fired.overdue

        # No scheduler ran at 11:00: within the grace the slot is only due, then overdue.
        (due,) = status(now=at(hours=1, seconds=59), schedules=[schedule])
        (late,) = status(now=at(hours=1, seconds=120), schedules=[schedule])
        assert (due.overdue, late.overdue, late.overdue_seconds) == (False, True, 120.0)
        export([late])
        gauge = REGISTRY.get_sample_value
        assert gauge("jobs_schedule_overdue_seconds", {"schedule": "hourly"}) == 120.0
        assert gauge("jobs_schedule_next_due_timestamp_seconds", {"schedule": "hourly"}) == (
            at(1).timestamp()
        )
        assert gauge("jobs_schedule_last_fired_slot_timestamp_seconds", {"schedule": "hourly"}) == (
            T.timestamp()
        )

        # The scheduler comes back: the missed slot is skipped (visibly) and nothing is overdue.
        CronService([schedule], identity="test").run_once(at(hours=1, seconds=120))
        (after,) = status(now=at(hours=1, seconds=121), schedules=[schedule])
        assert (after.overdue, after.last_skipped_slot, after.next_due) == (False, at(1), at(2))

    def test_status_uses_the_database_clock_by_default(self):
        schedule = make(cron="* * * * * *")
        (item,) = status(schedules=[schedule])
        with connection.cursor() as cur:
            cur.execute("SELECT statement_timestamp()")
            now = cur.fetchone()[0]
        assert now - timedelta(seconds=61) < item.next_due <= now + timedelta(seconds=1)


QUARTERLY = {**HOURLY, "cron": "*/15 * * * *"}


BERLIN = ZoneInfo("Europe/Berlin")


@pytest.mark.django_db(transaction=True)
def test_catch_up_from_at_the_end_of_a_spring_forward_gap_fires_the_slots_after_it():
    schedule = make(
        **QUARTERLY, misfire="all", timezone="Europe/Berlin", catch_up_from="2026-03-29T03:00"
    )
    now = datetime(2026, 3, 29, 4, 0, 5, tzinfo=BERLIN)  # 02:00:05 UTC

    decisions = schedule.plan(now, None)

    wall = [(d.slot.astimezone(BERLIN).strftime("%H:%M"), d.kind) for d in decisions]
    assert wall == [
        ("03:00", SlotKind.CATCH_UP),
        ("03:15", SlotKind.CATCH_UP),
        ("03:30", SlotKind.CATCH_UP),
        ("03:45", SlotKind.CATCH_UP),
        ("04:00", SlotKind.ON_TIME),
    ]  # not only 04:00


@pytest.mark.django_db(transaction=True)
def test_catch_up_from_given_in_utc_at_the_same_instant_already_works():
    schedule = make(
        **QUARTERLY,
        misfire="all",
        timezone="Europe/Berlin",
        catch_up_from=datetime(2026, 3, 29, 1, 0, tzinfo=UTC),  # 03:00 CEST
    )
    decisions = schedule.plan(datetime(2026, 3, 29, 2, 0, 5, tzinfo=UTC), None)
    assert [d.kind for d in decisions].count(SlotKind.CATCH_UP) == 4


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("value", "instant"),
    [
        ("2030-05-01T07:00:00+00:00", datetime(2030, 5, 1, 7, tzinfo=UTC)),
        ("2030-05-01T09:00+02:00", datetime(2030, 5, 1, 7, tzinfo=UTC)),
        ("2030-05-01T07:00Z", datetime(2030, 5, 1, 7, tzinfo=UTC)),
        ("2030-05-01", datetime(2030, 5, 1, tzinfo=UTC)),  # a date-only string: midnight
    ],
)
def test_catch_up_from_strings_with_and_without_an_offset(value, instant):
    assert make(catch_up_from=value).catch_up_from == instant


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("value", [datetime(2030, 5, 1).date(), 1_900_000_000, True, "yesterday"])
def test_catch_up_from_that_is_no_instant_is_refused_at_start_up(value):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="catch_up_from must be a datetime"):
        make(catch_up_from=value)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("misfire", ["skip", "once", "all"])
def test_catch_up_from_a_year_back_costs_bounded_work_whatever_the_misfire(misfire):
    schedule = make(
        cron="* * * * * *", misfire=misfire, max_catch_up=5, catch_up_from=T - timedelta(days=365)
    )
    started = time.monotonic()
    counts = CronService([schedule], identity="test").run_once(T + timedelta(seconds=0.5))
    assert time.monotonic() - started < 5
    # Every slot inside the grace (60 s: 60 slots) fires on time, as after any downtime; only
    # the older ones go to the misfire policy, bounded by max_catch_up.
    expected = {"skip": (60, 0, 1), "once": (60, 1, 0), "all": (60, 5, 1)}[misfire]
    assert (counts.on_time, counts.catch_up, counts.skipped) == expected
    assert ScheduleSlot.objects.count() == sum(expected)


@pytest.mark.django_db(transaction=True)
def test_catch_up_from_exactly_on_a_slot_fires_that_slot():
    schedule = make(misfire="all", catch_up_from=T - timedelta(hours=2))
    decisions = schedule.plan(T + timedelta(seconds=5), None)
    assert decisions[0] == Decision(T - timedelta(hours=2), SlotKind.CATCH_UP)


@pytest.mark.django_db(transaction=True)
def test_two_schedulers_racing_a_new_schedules_first_tick_fire_its_slot_once(threads):
    schedule = make(cron="* * * * * *", catch_up_from=T - timedelta(seconds=3), misfire="all")

    def tick(i):
        return CronService([schedule], identity=f"s{i}").run_once(T + timedelta(seconds=i * 0.4))

    counts = threads(4, tick)
    assert sum(c.on_time + c.catch_up for c in counts) == ScheduleSlot.objects.count()
    assert Job.objects.count() == ScheduleSlot.objects.count()
    assert ScheduleSlot.objects.values("slot").distinct().count() == ScheduleSlot.objects.count()


@pytest.mark.django_db(transaction=True)
def test_a_new_schedule_without_catch_up_from_is_never_reported_overdue():
    schedule = make()
    (before,) = status(now=T + timedelta(minutes=30), schedules=[schedule])
    assert not before.overdue and before.next_due == T + timedelta(hours=1)


@pytest.mark.django_db(transaction=True)
def test_status_of_a_new_schedule_starting_in_the_future_says_when_it_will_fire():
    start = T + timedelta(days=3)
    schedule = make(catch_up_from=start)
    now = T + timedelta(minutes=30)
    assert schedule.plan(now + timedelta(hours=1), None) == []  # it really does not fire

    (item,) = status(now=now, schedules=[schedule])

    assert item.next_due == start  # not T + 1 hour, a slot that never fires
