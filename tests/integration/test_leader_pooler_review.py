"""A hostile review of the scheduler's transaction-held leadership, directly and through PgBouncer.

Each test is a way the term, its proofs or the fence could break: a pid the operating system
hands to the next leader's backend, a term aborted by an error, limits a DBA sets for the
role or database, a pooler that recycles, reconnects or kills its server connections, and the
keeper and the loop racing on the lock session. See docs/scheduler.md ("Leadership").
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
from jobs.scheduler.leader import Leadership, LeadershipLost
from tests.integration import test_leader_pooler as base
from tests.pgbouncer import (
    PgBouncer,
    pgbouncer_fixture,  # noqa: F401  (provides `pgbouncer`)
    skip_reason,
)
from tests.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

# The leader tests' fixtures: each case straight to PostgreSQL and through the pooler, and
# Leadership objects on a test key, released at teardown.
route, contenders, wait_for, KEY = base.route, base.contenders, base.wait_for, base.KEY
_straight_to_postgresql, direct, lock_holders = (
    base._straight_to_postgresql,
    base.direct,
    base.lock_holders,
)

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


# -- the fence ---------------------------------------------------------------------------------


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


# -- the keeper ----------------------------------------------------------------------------------


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


# -- the term's transaction --------------------------------------------------------------------


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


# -- the pooler's own maintenance -------------------------------------------------------------


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
