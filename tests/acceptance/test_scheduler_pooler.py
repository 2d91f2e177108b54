"""Real ``runscheduler`` processes through PgBouncer in transaction mode.

The pooler is tests/support/pgbouncer.py. The same guarantees as straight to PostgreSQL
(tests/acceptance/test_scheduler_processes.py): one leads, ``kill -9`` hands over at once, a stopped
leader is cut off by the server after the leader timeout (two seconds here) and stands down when it
wakes, and no slot fires twice or goes missing. Every duty runs often, so each of them goes through
the pooler too."""

from __future__ import annotations

import signal
import time

import psycopg
import pytest

from jobs.db import bounds as dbbounds
from jobs.scheduler.leader import LOCK_KEY
from tests.support.pgbouncer import pgbouncer_fixture  # noqa: F401  (provides `pgbouncer`)
from tests.support.polling import wait_for
from tests.support.schedulers import (
    LEADS,
    SCHEDULER,
    assert_each_slot_fired_once_without_gaps,
    fired_by,
    metric,
    port,
)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.acceptance,
    pytest.mark.slow,
    pytest.mark.once,
]

DUTIES = ("cron", "watchdog", "retention", "archive", "release", "gauges")
OFTEN = [
    *("--watchdog-interval", "0.2", "--retention-interval", "0.5"),
    *("--archive-interval", "0.2", "--gauge-interval", "0.2"),
]


def start_pair(spawn, pgbouncer):
    """Two schedulers whose every connection goes through the pooler: (leader, standby)."""
    url = pgbouncer.database_url()
    a, b = (spawn(*SCHEDULER, *OFTEN, DATABASE_URL=url) for _ in range(2))
    leader = wait_for(
        lambda: next((p for p in (a, b) if LEADS in p.output()), None), what="a leader", timeout=20
    )
    standby = b if leader is a else a
    standby.wait_for_output("stands by")
    return leader, standby


def lock_holder() -> str | None:
    """The application_name of the backend holding the leader lock (straight to PostgreSQL)."""
    with psycopg.connect(**dbbounds.connect_params(bounds=dbbounds.Bounds(0, 0, 0))) as conn:
        row = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid",
            [LOCK_KEY >> 32, LOCK_KEY & 0xFFFFFFFF],
        ).fetchone()
    return row[0] if row else None


def assert_every_duty_ran_cleanly(process) -> None:
    scheduler_port = port(process)
    for duty in DUTIES:
        labels = f'{{duty="{duty}"}}'
        wait_for(
            lambda labels=labels: metric(scheduler_port, "jobs_scheduler_passes_total", labels),
            what=f"a {duty} pass through the pooler",
            timeout=20,
        )
        assert not metric(scheduler_port, "jobs_scheduler_errors_total", labels), duty
    assert "pass failed" not in process.output()


def test_through_the_pooler_one_leads_and_kill_9_hands_over_at_once(spawn, pgbouncer):
    leader, standby = start_pair(spawn, pgbouncer)
    wait_for(lambda: fired_by(leader) >= 3, what="the leader fired slots", timeout=20)
    assert fired_by(standby) == 0
    # The lock lives on a pooled server connection lent to the leader's lock session.
    assert f":{leader.pid}:" in (lock_holder() or "")
    assert_every_duty_ran_cleanly(leader)

    leader.proc.kill()  # the pooler drops the server connection its client left mid-term
    killed = time.monotonic()
    leader.wait()
    standby.wait_for_output(LEADS, timeout=10)
    took_over = time.monotonic() - killed
    wait_for(lambda: fired_by(standby) >= 3, what="the new leader fired slots", timeout=20)
    assert f":{standby.pid}:" in (lock_holder() or "")
    standby.signal(signal.SIGTERM)
    assert standby.wait() == 0

    assert pgbouncer.leftovers() == {}  # every duty ran: nothing kept on any server connection
    assert took_over < 1.5, f"the standby led {took_over:.2f}s after the kill"
    print(f"through the pooler, kill -9: standby led after {took_over:.2f}s")
    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_through_the_pooler_a_stopped_leader_is_cut_off_and_stands_down(spawn, pgbouncer):
    leader, standby = start_pair(spawn, pgbouncer)
    wait_for(lambda: fired_by(leader) >= 2, what="the leader fired slots", timeout=20)

    leader.signal(signal.SIGSTOP)  # its term idles: the server ends it after 2 s
    stopped = time.monotonic()
    standby.wait_for_output(LEADS, timeout=10)
    took_over = time.monotonic() - stopped
    wait_for(lambda: fired_by(standby) >= 2, what="the new leader fired slots", timeout=20)
    leader.signal(signal.SIGCONT)
    leader.wait_for_output("lost leadership")
    fired = fired_by(standby)
    wait_for(lambda: fired_by(standby) >= fired + 2, what="the new leader carried on", timeout=20)
    assert f":{standby.pid}:" in (lock_holder() or "")
    for process in (leader, standby):
        process.signal(signal.SIGTERM)
        assert process.wait() == 0

    assert pgbouncer.leftovers() == {}
    assert 1.5 <= took_over < 4.0, f"the standby led {took_over:.2f}s after the stop"
    print(f"through the pooler, SIGSTOP: standby led after {took_over:.2f}s")
    assert_each_slot_fired_once_without_gaps(leader, standby)


def test_a_pooler_pause_waits_no_longer_than_the_leader_timeout(spawn, pgbouncer):
    """PAUSE waits for every server connection to be released, the leader's term's too.

    The leader's loop queues in the paused pooler; its stall guard steps down after the leader
    timeout and closes the lock session, which releases the last server connection.
    """
    leader, standby = start_pair(spawn, pgbouncer)
    wait_for(lambda: fired_by(leader) >= 2, what="the leader fired slots", timeout=20)
    with psycopg.connect(**pgbouncer.connect_kwargs("pgbouncer")) as admin:
        asked = time.monotonic()
        admin.execute("PAUSE")
        paused = time.monotonic() - asked
        leader.wait_for_output("lost leadership: the scheduler loop has not moved for")
        admin.execute("RESUME")
    before = fired_by(leader) + fired_by(standby)
    wait_for(
        lambda: fired_by(leader) + fired_by(standby) >= before + 3,
        what="slots fire again",
        timeout=20,
    )
    for process in (leader, standby):
        process.signal(signal.SIGTERM)
        assert process.wait() == 0

    assert 1.5 <= paused < 4.0, f"PAUSE took {paused:.2f}s"
    print(f"through the pooler, PAUSE returned after {paused:.2f}s")
    assert_each_slot_fired_once_without_gaps(*(p for p in (leader, standby) if fired_by(p)))
