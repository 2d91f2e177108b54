"""Scheduler leadership through PgBouncer in transaction mode, and what its lock session holds.

The pooler (tests/pgbouncer.py) hands its few server connections out round robin, so a lock
that lived on a session would be left behind on a server connection that other clients get
next. Each test that compares runs both ways: straight to PostgreSQL and through the pooler.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from jobs.db import bounds as dbbounds
from jobs.scheduler.leader import LOCK_KEY, Leadership, LeadershipLost
from tests.pgbouncer import pgbouncer_fixture  # noqa: F401  (provides `pgbouncer`)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

KEY = LOCK_KEY + 11  # not the real scheduler's lock, nor the other leader tests'


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout}s")


@pytest.fixture(params=["direct", "pooler"])
def route(request):
    """Run the test straight to PostgreSQL, then again with every connection via the pooler."""
    if request.param == "direct":
        yield None
        return
    bouncer = request.getfixturevalue("pgbouncer")
    with bouncer.routing():  # the lock session is opened from this thread's alias settings
        yield bouncer


@pytest.fixture
def contenders():
    made: list[Leadership] = []

    def make(identity: str, **kwargs) -> Leadership:
        leadership = Leadership(identity, key=KEY, **kwargs)
        made.append(leadership)
        return leadership

    yield make
    for leadership in made:
        leadership.release()


_STRAIGHT: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _straight_to_postgresql(django_db_setup: None) -> None:
    """Keep the way straight to PostgreSQL before a test routes the alias via the pooler."""
    _STRAIGHT.clear()
    _STRAIGHT.update(dbbounds.connect_params(bounds=dbbounds.Bounds(0, 0, 0)))


def direct() -> psycopg.Connection[Any]:
    """A connection of the test's own straight to PostgreSQL, even while a pooler routes."""
    return psycopg.connect(**_STRAIGHT, autocommit=True)


def lock_holders() -> list[int]:
    with direct() as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
            [KEY >> 32, KEY & 0xFFFFFFFF],
        ).fetchall()
    return [pid for (pid,) in rows]


def test_exactly_one_leads_and_its_proofs_and_fence_hold_across_the_pool(route, contenders):
    a, b = contenders("a"), contenders("b")
    assert a.try_acquire()
    assert lock_holders() == [a.backend_pid]  # the pid is the server's, not the pooler's
    # Many transactions later, on every server connection of the pool, b still cannot lead
    # (a lock left on a pooled session would let b re-take it there) and a still proves it.
    for _ in range(3 * (route.pool_size if route else 2)):
        assert not b.try_acquire()
        assert a.prove()
        with transaction.atomic():
            a.fence()
    assert lock_holders() == [a.backend_pid]

    a.release()
    assert lock_holders() == []
    assert b.try_acquire() and lock_holders() == [b.backend_pid]


def test_the_lock_session_holds_no_snapshot_no_xid_and_no_table_lock(route, contenders):
    """Its term is one long transaction: it must not hold back vacuum or anyone's DDL."""
    a = contenders("a")
    assert a.try_acquire()
    wait_for(lambda: a.prove() and a.prove(), what="two proofs")
    with a._mutex, direct() as conn:  # no proof runs while we look
        state, xid, xmin = conn.execute(
            "SELECT state, backend_xid, backend_xmin FROM pg_stat_activity WHERE pid = %s",
            [a.backend_pid],
        ).fetchone()
        locks = conn.execute(
            "SELECT locktype FROM pg_locks WHERE pid = %s ORDER BY 1", [a.backend_pid]
        ).fetchall()
        assert (state, xid, xmin) == ("idle in transaction", None, None)
        assert locks == [("advisory",), ("virtualxid",)]  # nothing on pg_database or pg_locks
        # A migration's CREATE INDEX CONCURRENTLY waits for transactions with a snapshot:
        # it must not wait for the leader.
        conn.execute("SET lock_timeout = '3s'")
        conn.execute("CREATE TABLE leader_cic (x int)")
        try:
            started = time.monotonic()
            conn.execute("CREATE INDEX CONCURRENTLY leader_cic_x ON leader_cic (x)")
            assert time.monotonic() - started < 2.0
        finally:
            conn.execute("DROP TABLE leader_cic")


def test_nothing_it_sets_is_left_on_a_pooled_server_connection(pgbouncer, contenders):
    with pgbouncer.routing():
        a = contenders("a", timeout=timedelta(seconds=30))
        b = contenders("b", timeout=timedelta(seconds=30))
        assert a.try_acquire()
        for _ in range(pgbouncer.pool_size):
            assert not b.try_acquire()
            b.release()  # a fresh session for each attempt: each may set something anew
        a.release()
    # Every server connection of the pool: no setting (idle_session_timeout, say), no session
    # advisory lock, nothing prepared.
    assert pgbouncer.leftovers() == {}


def test_a_killed_leaders_lock_goes_with_its_connection(route, contenders):
    """kill -9 closes the client's socket: the lock must go at once, not after a timeout."""
    a = contenders("a", timeout=timedelta(seconds=30))
    b = contenders("b", timeout=timedelta(seconds=30))
    assert a.try_acquire()
    old = a.backend_pid
    dbbounds.abort(a._conn)  # the socket shut, as a killed process's is
    started = time.monotonic()
    wait_for(b.try_acquire, timeout=5, what="the standby took over")
    assert time.monotonic() - started < 5  # far below the 30 s idle bound
    assert lock_holders() == [b.backend_pid] != [old]
    assert not a.prove() and not a.leading
    with pytest.raises(LeadershipLost), transaction.atomic():
        a.fence()


def test_a_stalled_leader_loses_the_lock_after_the_timeout_and_stands_down(
    route, contenders, caplog
):
    """A leader that stops proving (SIGSTOP, a GC pause) is cut off by the server's bound."""
    timeout = timedelta(seconds=1)
    a, b = contenders("a", timeout=timeout), contenders("b", timeout=timeout)
    assert a.try_acquire()
    with a._mutex:  # a's keeper cannot prove: a is stalled
        stalled = time.monotonic()
        wait_for(b.try_acquire, timeout=5, what="the standby took over")
        took_over = time.monotonic() - stalled
        with transaction.atomic():
            b.fence()
    assert 0.7 <= took_over < 3.0, took_over
    wait_for(lambda: not a.leading, what="the woken leader stood down")
    assert "scheduler a lost leadership" in caplog.text
    with pytest.raises(LeadershipLost), transaction.atomic():
        a.fence()
    assert lock_holders() == [b.backend_pid]


def test_a_repeatable_read_default_does_not_give_the_term_a_snapshot(contenders):
    """The term must be READ COMMITTED whatever the server's default isolation is."""
    with direct() as conn:
        name = connection.settings_dict["NAME"]
        conn.execute(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'serializable'"
        )
        try:
            a = contenders("a")
            assert a.try_acquire() and a.prove()
            with a._mutex:
                xmin = conn.execute(
                    "SELECT backend_xmin FROM pg_stat_activity WHERE pid = %s", [a.backend_pid]
                ).fetchone()[0]
            assert xmin is None
        finally:
            conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_isolation')
