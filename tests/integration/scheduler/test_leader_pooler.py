"""Scheduler leadership through PgBouncer in transaction mode, and what its lock session holds.

The pooler (tests/support/pgbouncer.py) hands its few server connections out round robin, so a lock
that lived on a session would be left behind on a server connection that other clients get
next. Each test that compares runs both ways: straight to PostgreSQL and through the pooler.

The later tests each take a way the term, its proofs or the fence could break: a pid the
operating system hands to the next leader's backend, a term aborted by an error, limits a DBA
sets for the role or database, a pooler that recycles, reconnects or kills its server
connections, and the keeper and the loop racing on the lock session. See docs/scheduler.md
("Leadership").
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from jobs.db import bounds as dbbounds
from jobs.scheduler.leader import LOCK_KEY, Leadership, LeadershipLost
from tests.support.pgbouncer import (
    PgBouncer,
    pgbouncer_fixture,  # noqa: F401  (provides `pgbouncer`)
    skip_reason,
)
from tests.support.polling import wait_for
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

KEY = LOCK_KEY + 11  # not the real scheduler's lock, nor the other leader tests'


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


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def backend(pid: int) -> dict[str, Any] | None:
    """pg_stat_activity's row for ``pid`` (straight to PostgreSQL), or None once it is gone."""
    with direct() as conn:
        cur = conn.execute(
            "SELECT state, query_start, xact_start, backend_xmin, backend_xid "
            "FROM pg_stat_activity WHERE pid = %s",
            [pid],
        )
        row = cur.fetchone()
        names = [column.name for column in cur.description or []]
    return dict(zip(names, row, strict=True)) if row else None


@contextlib.contextmanager
def database_settings(**values: str) -> Iterator[None]:
    """``ALTER DATABASE … SET`` for the test database, as a DBA would; reset on the way out."""
    name = connection.settings_dict["NAME"]
    with direct() as conn:
        for key, value in values.items():
            conn.execute(f"ALTER DATABASE \"{name}\" SET {key} = '{value}'")
        try:
            yield
        finally:
            for key in values:
                conn.execute(f'ALTER DATABASE "{name}" RESET {key}')


def admin(bouncer: PgBouncer, command: str) -> None:
    """One command on PgBouncer's admin console (RECONNECT, KILL db, RESUME db, ...)."""
    with psycopg.connect(**bouncer.connect_kwargs("pgbouncer")) as conn:
        conn.execute(command)


def lead_on_pid(pid: int, make: Callable[[], Leadership], tries: int = 50) -> Leadership | None:
    """A new leader whose lock session's backend gets ``pid``, as after a pid wrap-around.

    Linux hands out the number after ``ns_last_pid`` to the next fork (the postmaster's, for a
    new connection) when it is free; another fork on the machine in between takes it first,
    so this tries a few times.
    """
    for _ in range(tries):
        with open(NS_LAST_PID, "w") as handle:
            handle.write(str(pid - 1))
        leadership = make()
        if leadership.try_acquire() and leadership.backend_pid == pid:
            return leadership
        leadership.release()
    return None


@pytest.mark.skipif(
    not os.access(NS_LAST_PID, os.W_OK) or os.geteuid() != 0,
    reason="choosing the next pid needs root and a writable /proc/sys/kernel/ns_last_pid",
)
def test_a_stale_leaders_fence_fails_when_its_old_pid_now_holds_the_lock_for_a_new_leader(
    contenders,
):
    """Backend pids are operating-system pids and come round again (pid_max is often 32768).

    A leader that stalled past its timeout lost its term: the server ended its backend. If the
    next leader's lock session is then given the same pid, a fence by pid alone says the stale
    leader still holds the lock, and it goes on ticking beside the real one.
    """
    a = contenders("a", timeout=timedelta(seconds=1))
    assert a.try_acquire()
    old = a.backend_pid
    assert old is not None
    with a._mutex:  # a stalls: its keeper cannot prove, the server ends its idle term
        wait_for(lambda: backend(old) is None, timeout=5, what="the server ended a's term")
        b = lead_on_pid(old, lambda: contenders("b", timeout=timedelta(seconds=30)))
        if b is None:
            pytest.skip(f"pid {old} went to another process each time (a busy machine)")
        assert lock_holders() == [old] and a.leading  # the new leader, on a's old pid
        with pytest.raises(LeadershipLost), transaction.atomic():
            a.fence()
        with transaction.atomic():
            b.fence()
    wait_for(lambda: not a.leading, what="the woken leader stood down")


def test_a_leadership_released_and_won_again_is_kept_by_its_keeper(contenders):
    """Leadership objects outlive a release (a Scheduler run twice, tests): a new term must
    be proved on its timer again, or the server's idle bound ends it between duties."""
    a = contenders("a", timeout=timedelta(seconds=1))
    assert a.try_acquire()
    a.release()
    assert a.try_acquire()
    pid = a.backend_pid
    assert pid is not None
    won = backend(pid)
    assert won is not None

    def proved() -> bool:
        now = backend(pid)
        return now is not None and now["query_start"] > won["query_start"]

    wait_for(proved, timeout=3, what="the keeper proved the new term")
    assert a.prove() and lock_holders() == [pid]


def test_the_keeper_and_the_loop_racing_on_the_lock_session(route, contenders):
    """The keeper, the loop's proofs, the cron fence and the stall guard's step-down on four
    threads at once: every proof before the step-down holds, none after, and the lock is
    free at once."""
    a = contenders("a", timeout=timedelta(seconds=30))
    b = contenders("b", timeout=timedelta(seconds=30))
    assert a.try_acquire()
    a.proof_interval = 0.001  # the keeper proves as fast as it can
    results: list[bool] = []
    errors: list[BaseException] = []
    stepped = threading.Event()

    def prover() -> None:
        try:
            for _ in range(60):
                before = stepped.is_set()
                held = a.prove()
                if before:
                    assert not held
                results.append(held)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=prover) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(results) >= 30, what="proofs from every thread")
    with transaction.atomic():
        a.fence()
    assert a.step_down("the stall guard (test)")
    stepped.set()
    for thread in threads:
        thread.join(10)
    assert not errors, errors
    assert True in results and not a.leading
    wait_for(b.try_acquire, timeout=3, what="the standby took over at once")
    assert lock_holders() == [b.backend_pid]


def test_a_term_aborted_by_an_error_ends_at_once_and_leaves_nothing(route, contenders):
    """An error inside the term (a proof cancelled by statement_timeout) aborts its
    transaction: PostgreSQL frees its locks at once, every later statement fails until
    ROLLBACK. The fence by pid then fails; the next proof stands down, and through the
    pooler the aborted server connection is dropped with its client, not lent to another."""
    a = contenders("a", timeout=timedelta(seconds=30))
    b = contenders("b", timeout=timedelta(seconds=30))
    assert a.try_acquire()
    old = a.backend_pid
    with a._mutex:
        with pytest.raises(psycopg.errors.DivisionByZero):
            a._send("SELECT 1 / 0")  # stands for any statement of the term that fails
        assert lock_holders() == []  # the abort freed the lock; a has not noticed yet
        assert a.leading and old is not None
        with pytest.raises(LeadershipLost), transaction.atomic():
            a.fence()
        assert not a.prove() and not a.leading
    assert b.try_acquire() and lock_holders() == [b.backend_pid]
    wait_for(lambda: backend(old) is None, what="the aborted server connection dropped")
    with direct() as conn:
        stuck = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction (aborted)'"
        ).fetchone()
    assert stuck == (0,)


class FailingRollback(Leadership):
    """A standby whose ROLLBACK fails once: its socket is shut just before it is sent."""

    failures = 1

    def _send(self, sql: str, params: Any = None) -> psycopg.Cursor[Any]:
        if sql == "ROLLBACK" and self.failures and self._conn is not None:
            self.failures -= 1
            dbbounds.abort(self._conn)
        return super()._send(sql, params)


def test_a_standby_whose_rollback_fails_holds_nothing_and_stands_by(route, contenders):
    a = contenders("a", timeout=timedelta(seconds=30))
    assert a.try_acquire()
    b = FailingRollback("b", key=a.key, timeout=timedelta(seconds=30))
    try:
        assert not b.try_acquire() and b.reachable and not b.failures
        assert not b.leading and lock_holders() == [a.backend_pid]

        def in_transaction() -> list[int]:
            with direct() as conn:
                rows = conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state LIKE 'idle in transaction%%' AND pid <> %s",
                    [a.backend_pid],
                ).fetchall()
            return [pid for (pid,) in rows]

        wait_for(lambda: not in_transaction(), what="no other open transaction")
        assert not b.try_acquire()
    finally:
        b.release()


def test_nothing_the_term_runs_takes_a_snapshot_that_stays(route, contenders):
    """Between its statements the term has no xmin: right after winning, and after proofs."""
    a = contenders("a", timeout=timedelta(seconds=30))
    with a._mutex:  # the keeper does not prove: this is the state the acquisition left
        assert a.try_acquire()
        pid = a.backend_pid
        assert pid is not None
        state = backend(pid)
        assert state is not None
        assert (state["state"], state["backend_xmin"], state["backend_xid"]) == (
            "idle in transaction",
            None,
            None,
        )
        assert a.prove()
        with transaction.atomic():
            a.fence()
        state = backend(pid)
        assert state is not None and state["backend_xmin"] is None


def test_the_roles_and_databases_limits_on_transactions_do_not_end_a_live_term(route, contenders):
    """A DBA's database-wide transaction_timeout (PostgreSQL 17+) and a short
    idle_in_transaction_session_timeout would end any long transaction: the term sets
    its own (LOCAL) values, so it lives as long as it is proved, and ends when it is not."""
    with database_settings(
        transaction_timeout="400ms", idle_in_transaction_session_timeout="150ms"
    ):
        if route is not None:
            admin(route, "RECONNECT")  # the pool's servers start again with the new defaults
        with direct() as conn:
            assert conn.execute("SHOW transaction_timeout").fetchone() == ("400ms",)
        a = contenders("a", timeout=timedelta(seconds=2))  # proves every 0.4 s
        b = contenders("b", timeout=timedelta(seconds=2))
        assert a.try_acquire()
        pid = a.backend_pid
        assert pid is not None

        def term_age() -> float:
            assert lock_holders() == [pid], "the term ended while it was proved"
            assert not b.try_acquire()
            with direct() as conn:
                row = conn.execute(
                    "SELECT extract(epoch FROM now() - xact_start)::float "
                    "FROM pg_stat_activity WHERE pid = %s",
                    [pid],
                ).fetchone()
            return row[0] if row else 0.0

        wait_for(lambda: term_age() > 1.2, timeout=5, what="a term three limits long")
        with a._mutex:  # now a stalls: its own bound (2 s), not the database's, ends it
            stalled = time.monotonic()
            wait_for(b.try_acquire, timeout=5, what="the standby took over")
            assert 1.5 < time.monotonic() - stalled < 4


class SlowProxy(TcpProxy):
    """A path whose every answer from the server arrives ``delay`` seconds late (a far pooler)."""

    delay = 0.15

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            for sock in peers:
                selector.register(sock, selectors.EVENT_READ)
            while not self._closed.is_set():
                for key, _ in selector.select(timeout=0.1):
                    try:
                        data = key.fileobj.recv(65536)
                        if not data:
                            return self._drop(client, upstream)
                        if key.fileobj is upstream:
                            time.sleep(self.delay)  # the latency this path stands for
                        peers[key.fileobj].sendall(data)
                    except OSError:
                        return self._drop(client, upstream)


def test_no_moment_of_a_term_waits_under_the_roles_idle_bound(contenders):
    """Between BEGIN and the statement that sets the term's own bound, the session is idle in
    a transaction under the role's idle_in_transaction_session_timeout: none by default (a
    process stopped there pins a pooled server connection for good), or one shorter than a
    round trip, which ends every term before its lock is tried. The two go as one query."""
    with database_settings(idle_in_transaction_session_timeout="50ms"), SlowProxy() as proxy:
        shared = connection.settings_dict
        saved = {key: shared.get(key) for key in ("HOST", "PORT")}
        shared.update(HOST=proxy.host, PORT=str(proxy.port))
        try:
            a = contenders("a", timeout=timedelta(seconds=3))
            assert a.try_acquire(), "no term could start: the role's bound ended each one"
        finally:
            shared.update(saved)
        assert lock_holders() == [a.backend_pid]
        assert a.prove()


class RecyclingPgBouncer(PgBouncer):
    """A pooler that closes server connections after one second of age or idleness."""

    def _config(self) -> str:
        return super()._config() + "server_lifetime = 1\nserver_idle_timeout = 1\n"


@pytest.fixture
def recycling(django_db_setup: None) -> Iterator[PgBouncer]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with RecyclingPgBouncer() as bouncer:
        yield bouncer


def test_the_pooler_recycling_reconnecting_and_killing_its_servers(recycling, contenders):
    """server_lifetime, server_idle_timeout and RECONNECT close a server only once it is
    released: the leader's term keeps its server. KILL drops it: the leader stands down,
    and after RESUME a standby leads. Never two holders."""
    with recycling.routing():
        a = contenders("a", timeout=timedelta(seconds=30))
        b = contenders("b", timeout=timedelta(seconds=30))
        assert a.try_acquire()
        pid = a.backend_pid
        assert pid is not None
        others = {row["remote_pid"] for row in recycling.show("SERVERS")} - {pid}

        def recycled() -> bool:
            assert a.prove() and lock_holders() == [pid]
            assert not b.try_acquire()
            now = {row["remote_pid"] for row in recycling.show("SERVERS")}
            return pid in now and not others & now  # every other server was replaced

        wait_for(recycled, timeout=8, what="the pooler recycled every other server")
        admin(recycling, "RECONNECT")
        assert a.prove() and lock_holders() == [pid] and not b.try_acquire()

        admin(recycling, f"KILL {recycling.dbname}")
        wait_for(lambda: not a.prove(), timeout=3, what="the killed leader stood down")
        wait_for(lambda: lock_holders() == [], timeout=3, what="the lock freed")
        admin(recycling, f"RESUME {recycling.dbname}")
        wait_for(b.try_acquire, timeout=5, what="a standby led after RESUME")
        assert lock_holders() == [b.backend_pid] and not a.leading
