"""Real ``runscheduler`` processes: one leads, kill -9 / SIGSTOP / SIGTERM hand over, and no
slot ever fires twice. The schedule fires every second (tests/runapp/settings_scheduler.py)."""

from __future__ import annotations

import os
import signal
import time

import psycopg
import pytest
from django.db.models.functions import Now

from jobs.db import bounds as dbbounds
from jobs.scheduler.slots import TICK_LOCK_NAMESPACE
from tests.runapp.models import QuickRun
from tests.support.polling import wait_for
from tests.support.processes import Process, database_url_for_tests
from tests.support.schedulers import (
    LEADS,
    SCHEDULER,
    assert_each_slot_fired_once_without_gaps,
    fired_by,
    get,
    metric,
    port,
)
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]


def start_pair(spawn, *extra: str):
    """Start two schedulers at once; return (leader, standby) once each knows its role."""
    a, b = spawn(*SCHEDULER, *extra), spawn(*SCHEDULER, *extra)
    leader = wait_for(
        lambda: next((p for p in (a, b) if LEADS in p.output()), None), what="a leader", timeout=20
    )
    standby = b if leader is a else a
    standby.wait_for_output("stands by")
    return leader, standby


def test_killing_the_leader_hands_over_without_a_double_fired_or_lost_slot(spawn):
    leader, standby = start_pair(spawn)
    wait_for(lambda: fired_by(leader) >= 3, what="the leader fired slots", timeout=20)
    assert fired_by(standby) == 0

    leader.proc.kill()  # SIGKILL: no cleanup, the lock goes with the session
    leader.wait()
    standby.wait_for_output(LEADS, timeout=10)
    wait_for(lambda: fired_by(standby) >= 3, what="the new leader fired slots", timeout=20)
    standby.signal(signal.SIGTERM)
    assert standby.wait() == 0

    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_a_stalled_leader_is_replaced_and_stands_down_when_it_wakes(spawn):
    leader, standby = start_pair(spawn)
    wait_for(lambda: fired_by(leader) >= 2, what="the leader fired slots", timeout=20)

    leader.signal(signal.SIGSTOP)  # alive but silent: its session times out after 2 s
    standby.wait_for_output(LEADS, timeout=10)
    wait_for(lambda: fired_by(standby) >= 2, what="the new leader fired slots", timeout=20)
    leader.signal(signal.SIGCONT)
    leader.wait_for_output("lost leadership")
    fired = fired_by(standby)
    wait_for(lambda: fired_by(standby) >= fired + 2, what="the new leader carried on", timeout=20)
    for process in (leader, standby):
        process.signal(signal.SIGTERM)
        assert process.wait() == 0

    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_sigterm_hands_over_at_once_and_both_report_health(spawn):
    leader, standby = start_pair(spawn)
    leader_port, standby_port = port(leader), port(standby)
    for p in (leader_port, standby_port):
        assert get(p, "/healthz")[0] == get(p, "/readyz")[0] == 200  # leader or standby
    assert metric(leader_port, "jobs_scheduler_leader") == 1.0
    assert metric(standby_port, "jobs_scheduler_leader") == 0.0
    labels = '{schedule="every-second"}'
    wait_for(
        lambda: metric(standby_port, "jobs_schedule_next_due_timestamp_seconds", labels),
        what="the standby exports schedule status too",
        timeout=20,
    )
    # The leader exports a schedule's status once its gauges pass has run, which may come
    # after the standby's on a busy machine.
    wait_for(
        lambda: metric(leader_port, "jobs_schedule_overdue_seconds", labels) is not None,
        what="the leader exports schedule status",
        timeout=20,
    )
    assert metric(leader_port, "jobs_schedule_overdue_seconds", labels) == 0.0

    leader.signal(signal.SIGTERM)
    assert leader.wait(timeout=10) == 0
    assert "released leadership" in leader.output()
    standby.wait_for_output(LEADS, timeout=5)
    assert metric(standby_port, "jobs_scheduler_leader") == 1.0


def test_the_watchdog_reaps_the_run_of_a_killed_worker_and_frees_its_key(spawn):
    run = QuickRun.objects.create(job_id="nightly-curation", state="running")
    pulse = spawn(
        "shell",
        "-c",
        "import time\n"
        "from django.db.models.functions import Now\n"
        "from tests.runapp.models import QuickRun\n"
        "while True:\n"
        f"    QuickRun.objects.filter(pk={run.pk}).update(heartbeat_at=Now())\n"
        "    time.sleep(0.05)\n",
    )
    wait_for(
        lambda: QuickRun.objects.get(pk=run.pk).heartbeat_at,
        what="the run's first pulse",
        timeout=20,
    )
    scheduler = spawn(*SCHEDULER, "--watchdog-interval", "0.2")
    scheduler_port = port(scheduler)
    watchdog = ("jobs_scheduler_passes_total", '{duty="watchdog"}')
    # Several passes over a run older than its stale_after (1 s): a live pulse keeps it.
    wait_for(
        lambda: (metric(scheduler_port, *watchdog) or 0) >= 8, what="watchdog passes", timeout=20
    )
    assert QuickRun.objects.get(pk=run.pk).state == "running"

    pulse.proc.kill()  # the worker dies; its row stays running with a stale heartbeat
    wait_for(lambda: QuickRun.objects.get(pk=run.pk).state == "failed", what="reaped", timeout=20)
    reaped = QuickRun.objects.get(pk=run.pk)
    assert reaped.last_error == "stale"
    assert f"reaped as stale 1 rows of runapp.quickrun: ids [{run.pk}]" in scheduler.output()
    # The active-state lock is free: the next run with the same key can start.
    QuickRun.objects.create(job_id="nightly-curation", state="running", heartbeat_at=Now())


BOUNDED = [*SCHEDULER]
BOUNDED[BOUNDED.index("tests.runapp.settings_scheduler")] = "tests.runapp.settings_scheduler_bounds"


@pytest.fixture
def launch(tmp_path):
    """Like ``spawn``, with environment overrides (a database URL, the bounds switch)."""
    started: list[Process] = []
    base = {
        **os.environ,
        "DATABASE_URL": database_url_for_tests(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "INFO",
    }

    def start(*args: str, **env: str) -> Process:
        log = tmp_path / f"launched-{len(started)}.log"
        process = Process(list(args), log, {**base, **env})
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def hold_tick_lock(name: str = "every-second") -> psycopg.Connection:
    """A transaction of the test's own that holds the schedule's tick lock: ticks block."""
    conn = psycopg.connect(**dbbounds.connect_params(bounds=dbbounds.Bounds(0, 0, 0)))
    conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [TICK_LOCK_NAMESPACE, name])
    return conn


def test_a_leader_stuck_in_the_database_steps_down_and_the_standby_takes_over(launch):
    unbounded = {"TEST_JOBS_DB_BOUNDS": "off"}  # nothing cancels the stuck call but the leader
    leader = launch(*BOUNDED, **unbounded)
    leader.wait_for_output(LEADS)
    standby = launch(*BOUNDED, **unbounded)
    standby.wait_for_output("stands by")
    wait_for(lambda: fired_by(leader) >= 2, what="the leader fired slots", timeout=20)

    holder = hold_tick_lock()  # the leader's next tick waits for this lock, unbounded
    blocked = time.monotonic()
    try:
        standby.wait_for_output(LEADS, timeout=15)
        took_over = time.monotonic() - blocked
        leader.wait_for_output("lost leadership: the scheduler loop has not moved for")
    finally:
        holder.rollback()  # the new leader's first tick waits for it too
        holder.close()
    stepped_down = leader.output()
    assert "(stuck in the cron pass)" in stepped_down
    assert "aborted its database connection, stuck in the cron pass" in stepped_down
    fired = fired_by(standby)
    wait_for(lambda: fired_by(standby) >= fired + 2, what="the new leader fired slots", timeout=20)
    for process in (leader, standby):
        process.signal(signal.SIGTERM)
        assert process.wait() == 0
    assert 2.0 <= took_over < 5.0, f"the standby led {took_over:.1f}s after the leader stuck"
    print(f"hung leader (stuck in the database): standby led after {took_over:.2f}s")
    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_a_leader_cut_off_by_a_silent_network_steps_down_and_the_standby_takes_over(launch):
    with TcpProxy() as proxy:
        leader = launch(*BOUNDED, DATABASE_URL=proxy.database_url())
        leader.wait_for_output(LEADS)
        leader_port = port(leader)
        standby = launch(*BOUNDED)  # reaches the database directly
        standby.wait_for_output("stands by")
        wait_for(lambda: fired_by(leader) >= 2, what="the leader fired slots", timeout=20)

        proxy.freeze()  # no byte passes, no socket closes: every call of the leader hangs
        cut = time.monotonic()
        leader.wait_for_output("lost leadership", timeout=15)
        stepped_down = time.monotonic() - cut
        standby.wait_for_output(LEADS, timeout=15)
        took_over = time.monotonic() - cut
        assert metric(leader_port, "jobs_scheduler_leader") == 0.0  # it says so, too
        fired = fired_by(standby)
        wait_for(
            lambda: fired_by(standby) >= fired + 2, what="the new leader fired slots", timeout=20
        )
        for process in (leader, standby):
            process.signal(signal.SIGTERM)
        assert standby.wait() == 0
    assert stepped_down < 4.0, f"the cut-off leader stepped down after {stepped_down:.1f}s"
    assert took_over < 5.0, f"the standby led {took_over:.1f}s after the cut"
    print(
        f"silent network drop: leader stepped down after {stepped_down:.2f}s, "
        f"standby led after {took_over:.2f}s"
    )
    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_once_while_another_leads_exits_with_the_stood_by_status(spawn):
    leader = spawn(*SCHEDULER)
    leader.wait_for_output(LEADS)
    once = spawn("runscheduler", "--settings", "tests.runapp.settings_scheduler", "--once")
    assert once.wait() == 3  # STOOD_BY: a cron-driven caller can tell it did nothing
    assert "stood by: another scheduler leads; nothing was done" in once.output()
    assert fired_by(once) == 0

    leader.signal(signal.SIGTERM)
    assert leader.wait() == 0
    # A run that starts within the second whose slot the leader fired last finds nothing due
    # yet: run again (each run is a new process, so a later second) until one fires a slot.
    deadline = time.monotonic() + 60
    while True:
        ran = spawn("runscheduler", "--settings", "tests.runapp.settings_scheduler", "--once")
        assert ran.wait() == 0
        assert "led: ran cron, watchdog, retention" in ran.output()
        if fired_by(ran) >= 1:
            break
        assert time.monotonic() < deadline, "no --once run fired a slot"


def test_a_bad_schedule_refuses_to_start_with_a_clear_message(spawn):
    process = spawn("runscheduler", "--settings", "tests.runapp.settings_bad_schedule")
    assert process.wait() != 0
    output = process.output()
    assert "JOBS['SCHEDULES']['bad-cron']: cron '61 * * * *' is not a valid cron expression" in (
        output
    )
    assert "job type 'nobody.registers.v1' is not registered" in output
    assert "invalid payload for jobapp.ping.v1: message: expected str, got int" in output
    assert "started" not in output
