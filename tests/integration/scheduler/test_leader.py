"""Leadership on real connections, and the scheduler loop run in-process."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings
from prometheus_client import REGISTRY

from jobs.catalogue.registry import get_registry
from jobs.catalogue.schedules import load_schedules
from jobs.models import ScheduleSlot
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.leader import FENCE_SQL, LOCK_KEY, Leadership, LeadershipLost
from jobs.scheduler.runner import Scheduler
from jobs.scheduler.slots import TICK_LOCK_NAMESPACE
from tests.runapp.models import QuickRun
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

KEY = LOCK_KEY + 7  # not the real scheduler's lock


@pytest.fixture
def contenders():
    made: list[Leadership] = []

    def make(identity: str, **kwargs) -> Leadership:
        leadership = Leadership(identity, key=kwargs.pop("key", KEY), **kwargs)
        made.append(leadership)
        return leadership

    yield make
    for leadership in made:
        leadership.release()


def terminate(pid: int) -> None:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", [pid])


def lock_holders(key: int = KEY) -> list[int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
            [key >> 32, key & 0xFFFFFFFF],
        )
        return [pid for (pid,) in cur.fetchall()]


def changes(event: str) -> float:
    return REGISTRY.get_sample_value("jobs_scheduler_leadership_changes_total", {"event": event})


class TestLeadership:
    def test_exactly_one_leads_and_release_hands_over(self, contenders):
        a, b = contenders("a"), contenders("b")
        assert a.try_acquire() and a.prove()
        assert not b.try_acquire() and not b.leading
        assert lock_holders() == [a.backend_pid]

        a.release()
        assert not a.leading and not a.prove()
        assert b.try_acquire() and lock_holders() == [b.backend_pid]

    def test_a_leader_that_loses_its_connection_steps_down_and_a_standby_takes_over(
        self, contenders, caplog
    ):
        a, b = contenders("a"), contenders("b")
        assert a.try_acquire()
        lost_before = changes("lost") or 0.0
        terminate(a.backend_pid)

        wait_for(b.try_acquire, what="the standby took over")
        assert not a.prove() and not a.leading
        assert changes("lost") == lost_before + 1
        assert "scheduler a lost leadership" in caplog.text
        assert lock_holders() == [b.backend_pid]

    def test_a_deposed_leader_cannot_commit_work(self, contenders):
        a, b = contenders("a"), contenders("b")
        assert a.try_acquire()
        with transaction.atomic():
            a.fence()  # leading: passes inside the transaction
        old_pid, old_term = a.backend_pid, a.term_id
        terminate(old_pid)
        wait_for(b.try_acquire, what="the standby took over")

        with pytest.raises(LeadershipLost), transaction.atomic():
            a.fence()
        with connection.cursor() as cur:  # the in-transaction check itself, by pid and term
            params = {"classid": KEY >> 32, "objid": KEY & 0xFFFFFFFF}
            cur.execute(FENCE_SQL, {**params, "pid": old_pid, "term": old_term})
            assert cur.fetchone()[0] is False
            cur.execute(FENCE_SQL, {**params, "pid": b.backend_pid, "term": b.term_id})
            assert cur.fetchone()[0] is True
            cur.execute(FENCE_SQL, {**params, "pid": b.backend_pid, "term": old_term})
            assert cur.fetchone()[0] is False  # b's pid, another term

    def test_the_lock_session_is_named_and_times_out_when_the_leader_stops_proving(
        self, contenders
    ):
        a = contenders("a", timeout=timedelta(seconds=3))
        assert a.try_acquire()
        with connection.cursor() as cur:
            cur.execute(
                "SELECT application_name FROM pg_stat_activity WHERE pid = %s", [a.backend_pid]
            )
            assert cur.fetchone()[0] == "jobs-scheduler a"
        # The server ends the lock session of a leader that stops proving for the timeout
        # (a stalled process; tests/acceptance stops one with SIGSTOP).
        assert a._conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[0] == "3s"
        assert a.proof_interval == 0.6


def every_second(**options):
    spec = {"cron": "* * * * * *", "job": "jobapp.ping.v1", "payload": {"message": "hi"}}
    return load_schedules({"every-second": {**spec, "grace": 3, **options}}, [], get_registry())


def scheduler(contenders, identity: str, **config) -> Scheduler:
    timeout = config.get("leader_timeout")
    return Scheduler(
        SchedulerConfig(identity=identity, install_signal_handlers=False, **config),
        schedules=every_second(),
        registry=get_registry(),
        leadership=contenders(identity, timeout=timeout),
    )


@contextlib.contextmanager
def schedule_locked(name: str = "every-second"):
    """Hold the schedule's tick lock on the test's connection: its ticks block in the database."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [TICK_LOCK_NAMESPACE, name])
        yield


def in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def duty_passes(duty: str) -> float:
    return REGISTRY.get_sample_value("jobs_scheduler_passes_total", {"duty": duty}) or 0.0


def cron_errors() -> float:
    return REGISTRY.get_sample_value("jobs_scheduler_errors_total", {"duty": "cron"}) or 0.0


class TestSchedulerLoop:
    def test_a_new_leader_runs_every_duty_at_once(self, contenders):
        stale = QuickRun.objects.create(job_id="run-1", state="running")
        QuickRun.objects.filter(pk=stale.pk).update(heartbeat_at=stale.created_at - timedelta(1))

        leader = scheduler(contenders, "leader")
        assert leader.run(until=lambda s: s.passes >= 1) == 0

        assert ScheduleSlot.objects.filter(schedule="every-second").exists()
        stale.refresh_from_db()
        assert (stale.state, stale.last_error) == ("failed", "stale")
        assert REGISTRY.get_sample_value("jobs_scheduler_leader") == 0  # released on exit
        assert lock_holders() == []

    def test_a_standby_does_nothing(self, contenders):
        holder = contenders("holder")
        assert holder.try_acquire()
        standby = scheduler(contenders, "standby")
        standby.run(until=lambda s: True)
        assert not standby.leadership.leading
        assert not ScheduleSlot.objects.exists()

    def test_once_leading_it_keeps_ticking(self, contenders):
        before = {duty: duty_passes(duty) for duty in ("cron", "release")}
        leader = scheduler(contenders, "leader", tick_interval=0.05)
        leader.run(until=lambda s: s.passes >= 3)
        assert leader.passes == 3
        # Duties of one interval share each pass: one wake-up per tick, not one per duty.
        assert {duty: duty_passes(duty) - before[duty] for duty in before} == {
            "cron": 3,
            "release": 3,
        }


class TestStuckLeader:
    """A duty blocked in the database: its bound cancels it, or the leader steps down."""

    @override_settings(JOBS={"DB_LOCK_TIMEOUT": 0.3, "DB_STATEMENT_TIMEOUT": 1})
    def test_a_tick_blocked_on_a_lock_is_cancelled_by_its_bound_and_the_leader_goes_on(
        self, contenders, caplog
    ):
        leader = scheduler(contenders, "leader", tick_interval=0.05, watchdog_interval=0.05)
        with schedule_locked():
            thread = in_thread(lambda: leader.run(until=lambda s: s.passes >= 4))
            # Before the bounds, the first tick waited for the lock forever.
            wait_for(lambda: not thread.is_alive(), what="four passes despite the held lock")
        assert "schedule every-second: tick failed" in caplog.text
        assert "lock timeout" in caplog.text
        assert "lost leadership" not in caplog.text
        assert not ScheduleSlot.objects.exists()

    @override_settings(JOBS={"DB_LOCK_TIMEOUT": 0, "DB_STATEMENT_TIMEOUT": 0})
    def test_a_leader_stuck_in_the_database_steps_down_and_a_standby_takes_over(
        self, contenders, caplog
    ):
        timeout = timedelta(seconds=1)
        leader = scheduler(contenders, "leader", tick_interval=0.05, leader_timeout=timeout)
        standby = contenders("standby", timeout=timeout)
        thread = in_thread(leader.run)
        try:
            wait_for(lambda: leader.passes >= 1, what="the leader ran a pass")
            with schedule_locked():  # no bound: its next tick waits for this lock for good
                blocked = time.monotonic()
                wait_for(standby.try_acquire, what="the standby took over")
                took_over = time.monotonic() - blocked
                assert not leader.leadership.leading
                assert "scheduler leader lost leadership: the scheduler loop has not moved for" in (
                    caplog.text
                )
                assert "(stuck in the cron pass)" in caplog.text
                # The stuck call was cut, not left waiting for the lock: the loop moves again.
                wait_for(lambda: "tick failed" in caplog.text, what="the stuck tick was aborted")
            assert 1.0 <= took_over < 3.0, took_over
            assert lock_holders() == [standby.backend_pid]
        finally:
            leader.request_stop()
            thread.join(10)
        assert not thread.is_alive()
