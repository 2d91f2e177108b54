"""Review round 11: batch order, per-type concurrency, a new schedule's first tick.

Each test states the contract it checks. Several failed on the code they were written against
(strict xfails until the fix): batch deadlocks between rounds, slot sharing between types
without limits, catch_up_from at a daylight-saving gap and in the status report.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from jobs import JobContext, Payload, queue
from jobs.models import Job, ScheduleSlot
from jobs.queue import AllTenants, ClaimRequest, NewJob
from jobs.queue import keys as keys_module
from jobs.registry import JobType, Policy, Registry, get_registry
from jobs.scheduler.cron import CronService
from jobs.scheduler.reporting import status
from jobs.scheduler.schedules import load_schedules
from jobs.scheduler.timing import Decision, SlotKind
from jobs.testing import run_worker
from tests.support.factories import JobFactory
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def claim_all(name: str, count: int) -> list[str]:
    claimed: list[str] = []
    for _ in range(count):
        claimed += [j.job_id for j in queue.claim([ClaimRequest(name, 1)], scope=AllTenants())]
    return claimed


# -- enqueue_many: order, ids, clock, concurrency -------------------------------------------


@pytest.mark.parametrize("size", [10_000, 50_000])
def test_a_huge_mixed_tenant_batch_gets_ids_in_exactly_the_given_order(size):
    # Keys in an order that is neither sorted nor reverse-sorted, over two tenants.
    given = [(f"t{n % 3}", f"k{(n * 7919) % size:06}") for n in range(size)]
    results = queue.enqueue_many([NewJob("a.v1", tenant=t, job_id=k) for t, k in given])

    assert [(r.tenant, r.job_id) for r in results] == given
    ids = [r.id for r in results]
    assert ids == sorted(ids) and len(set(ids)) == size
    in_id_order = Job.objects.order_by("id").values_list("tenant", "job_id")
    assert list(in_id_order) == given


def test_orm_inserts_after_a_batch_draw_from_the_same_sequence_and_never_collide():
    first = queue.enqueue_many([NewJob("a.v1", job_id=f"x{n}") for n in range(50)])
    made = Job.objects.create(name="a.v1", job_id="by-the-orm")
    second = queue.enqueue_many([NewJob("a.v1", job_id=f"y{n}") for n in range(5)])

    assert made.id > max(r.id for r in first)
    assert min(r.id for r in second) > made.id


def test_rows_inserted_in_a_later_round_share_the_first_rounds_clock_and_keep_delay():
    old = timezone.now() - timedelta(days=30)
    JobFactory(name="a.v1", job_id="late", succeeded=True, finished_at=old)  # expired holder
    batch = [
        NewJob("a.v1", job_id="early"),
        NewJob("a.v1", job_id="late", delay=timedelta(seconds=90)),
        NewJob("a.v1", job_id="early", delay=timedelta(seconds=5)),  # duplicate: the first wins
    ]
    with transaction.atomic():
        results = queue.enqueue_many(batch)
        with connection.cursor() as cur:
            cur.execute("SELECT statement_timestamp(), transaction_timestamp()")
            _, started = cur.fetchone()

    assert [r.created for r in results] == [True, True, False]
    assert results[0].id == results[2].id < results[1].id
    early, late = Job.objects.get(pk=results[0].id), Job.objects.get(pk=results[1].id)
    assert early.created_at == late.created_at >= started
    assert early.run_after == early.created_at
    assert late.run_after == late.created_at + timedelta(seconds=90)


@pytest.mark.parametrize("notify", [True, False])
def test_many_concurrent_batches_sharing_live_expired_and_free_keys_in_any_order(threads, notify):
    keys = [(tenant, f"k{n:03}") for n in range(50) for tenant in ("t1", "t2")]
    with override_settings(JOBS={"NOTIFY": notify}):
        for round_ in range(8):
            Job.objects.all().delete()
            old = timezone.now() - timedelta(days=30)
            live = set()
            for i, (tenant, key) in enumerate(keys):
                if i % 3 == 0:
                    JobFactory(
                        name="a.v1", tenant=tenant, job_id=key, succeeded=True, finished_at=old
                    )
                elif i % 5 == 0:
                    JobFactory(name="a.v1", tenant=tenant, job_id=key)
                    live.add((tenant, key))

            def enqueue_batch(i, round_=round_):
                cut = (i * 17 + round_) % len(keys)
                order = keys[cut:] + keys[:cut]
                if i % 2:
                    order.reverse()
                batch = [NewJob("a.v1", {"i": i}, tenant=t, job_id=k) for t, k in order]
                return order, queue.enqueue_many(batch + batch[:3])  # with duplicates

            results = threads(8, enqueue_batch, timeout=60)

            assert Job.objects.filter(key_held=True).count() == len(keys)
            created = sum(r.created for _, batch in results for r in batch)
            assert created == len(keys) - len(live)
            for order, batch in results:
                assert [(r.tenant, r.job_id) for r in batch[: len(order)]] == order
                mine = [r.id for r in batch[: len(order)] if r.created]
                assert mine == sorted(mine)  # what a batch inserted follows its given order


def _lock_waiters() -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cur.fetchone()[0]


def test_batches_sharing_keys_do_not_deadlock_when_a_key_is_freed_between_their_rounds(
    monkeypatch,
):
    old = timezone.now() - timedelta(days=30)
    JobFactory(name="a.v1", job_id="k1", succeeded=True, finished_at=old)  # expired holder
    live = JobFactory(name="a.v1", job_id="k2")  # a live holder, cancelled in between

    real_holders = keys_module.holders
    reached = {"A": threading.Event(), "B": threading.Event()}
    proceed = {"A": threading.Event(), "B": threading.Event()}

    def holders(cur, keys):
        me = threading.current_thread().name
        if me in proceed and not reached[me].is_set():  # after the first round only
            reached[me].set()
            assert proceed[me].wait(20)
        return real_holders(cur, keys)

    monkeypatch.setattr(keys_module, "holders", holders)
    errors: dict[str, BaseException] = {}

    def enqueue_both(name: str) -> None:
        try:
            queue.enqueue_many([NewJob("a.v1", job_id="k1"), NewJob("a.v1", job_id="k2")])
        except BaseException as exc:
            errors[name] = exc
        finally:
            connection.close()

    b = threading.Thread(target=enqueue_both, args=("B",), name="B")
    b.start()
    assert reached["B"].wait(10)  # B's first round skipped both keys (both held)
    assert queue.cancel([live.id], by="review") == [live.id]  # k2 is free now
    a = threading.Thread(target=enqueue_both, args=("A",), name="A")
    a.start()
    assert reached["A"].wait(10)  # A's first round inserted k2 (uncommitted), skipped k1
    proceed["B"].set()  # B releases k1's expired holder, inserts k1, then waits for A on k2
    wait_for(lambda: _lock_waiters() >= 1, what="B to wait for A", interval=0.01)
    proceed["A"].set()  # A releases k1's holder: it waits for B, which waits for A
    a.join(30)
    b.join(30)

    assert not errors, errors  # PostgreSQL ends one of them; that batch is tried again
    assert Job.objects.filter(key_held=True).count() == 2


# -- per-type concurrency ----------------------------------------------------------------


class SlowV1(Payload, name="review11.slow.v1"):
    n: int = 0


class QuickV1(Payload, name="review11.quick.v1"):
    n: int = 0


def test_types_without_a_limit_share_the_free_slots_of_one_claim():
    """Two unlimited types with work due, four slots: both run, neither waits for the other."""
    release = threading.Event()
    seen: list[str] = []
    lock = threading.Lock()

    def handler(payload, ctx: JobContext) -> None:
        with lock:
            seen.append(ctx.name)
        release.wait(10)

    for n in range(6):
        queue.enqueue_many([NewJob(SlowV1.job_name, {"n": n}), NewJob(QuickV1.job_name, {"n": n})])
    registry = Registry([JobType(SlowV1, handler, Policy()), JobType(QuickV1, handler, Policy())])
    first_four: list[str] = []

    def watch() -> None:
        try:
            wait_for(lambda: len(seen) >= 4, what="four jobs to start", interval=0.01)
            with lock:
                first_four.extend(seen[:4])
        finally:
            release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_worker(registry=registry, concurrency=4, timeout=30)
    finally:
        release.set()
        watcher.join(15)

    assert Job.objects.filter(state="succeeded").count() == 12
    # Before the fix all four first slots went to whichever name the rotation put first.
    assert set(Counter(first_four)) == {SlowV1.job_name, QuickV1.job_name}, first_four


# -- a new schedule's first tick, catch_up_from ------------------------------------------


HOURLY = {"cron": "0 * * * *", "job": "jobapp.ping.v1", "payload": {"message": "tick"}}
QUARTERLY = {**HOURLY, "cron": "*/15 * * * *"}
BERLIN = ZoneInfo("Europe/Berlin")


def make(name: str = "hourly", **options):
    (schedule,) = load_schedules({name: {**HOURLY, **options}}, [], get_registry())
    return schedule


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
    ]  # today: only 04:00


def test_catch_up_from_given_in_utc_at_the_same_instant_already_works():
    schedule = make(
        **QUARTERLY,
        misfire="all",
        timezone="Europe/Berlin",
        catch_up_from=datetime(2026, 3, 29, 1, 0, tzinfo=UTC),  # 03:00 CEST
    )
    decisions = schedule.plan(datetime(2026, 3, 29, 2, 0, 5, tzinfo=UTC), None)
    assert [d.kind for d in decisions].count(SlotKind.CATCH_UP) == 4


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


@pytest.mark.parametrize("value", [datetime(2030, 5, 1).date(), 1_900_000_000, True, "yesterday"])
def test_catch_up_from_that_is_no_instant_is_refused_at_start_up(value):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="catch_up_from must be a datetime"):
        make(catch_up_from=value)


T = datetime(2030, 5, 1, 10, tzinfo=UTC)


@pytest.mark.parametrize("misfire", ["skip", "once", "all"])
def test_catch_up_from_a_year_back_costs_bounded_work_whatever_the_misfire(misfire):
    schedule = make(
        cron="* * * * * *", misfire=misfire, max_catch_up=5, catch_up_from=T - timedelta(days=365)
    )
    started = time.monotonic()
    counts = CronService([schedule], identity="review").run_once(T + timedelta(seconds=0.5))
    assert time.monotonic() - started < 5
    # Every slot inside the grace (60 s: 60 slots) fires on time, as after any downtime; only
    # the older ones go to the misfire policy, bounded by max_catch_up.
    expected = {"skip": (60, 0, 1), "once": (60, 1, 0), "all": (60, 5, 1)}[misfire]
    assert (counts.on_time, counts.catch_up, counts.skipped) == expected
    assert ScheduleSlot.objects.count() == sum(expected)


def test_catch_up_from_exactly_on_a_slot_fires_that_slot():
    schedule = make(misfire="all", catch_up_from=T - timedelta(hours=2))
    decisions = schedule.plan(T + timedelta(seconds=5), None)
    assert decisions[0] == Decision(T - timedelta(hours=2), SlotKind.CATCH_UP)


def test_two_schedulers_racing_a_new_schedules_first_tick_fire_its_slot_once(threads):
    schedule = make(cron="* * * * * *", catch_up_from=T - timedelta(seconds=3), misfire="all")

    def tick(i):
        return CronService([schedule], identity=f"s{i}").run_once(T + timedelta(seconds=i * 0.4))

    counts = threads(4, tick)
    assert sum(c.on_time + c.catch_up for c in counts) == ScheduleSlot.objects.count()
    assert Job.objects.count() == ScheduleSlot.objects.count()
    assert ScheduleSlot.objects.values("slot").distinct().count() == ScheduleSlot.objects.count()


def test_a_new_schedule_without_catch_up_from_is_never_reported_overdue():
    schedule = make()
    (before,) = status(now=T + timedelta(minutes=30), schedules=[schedule])
    assert not before.overdue and before.next_due == T + timedelta(hours=1)


def test_status_of_a_new_schedule_starting_in_the_future_says_when_it_will_fire():
    start = T + timedelta(days=3)
    schedule = make(catch_up_from=start)
    now = T + timedelta(minutes=30)
    assert schedule.plan(now + timedelta(hours=1), None) == []  # it really does not fire

    (item,) = status(now=now, schedules=[schedule])

    assert item.next_due == start  # today: T + 1 hour, a slot that never fires
