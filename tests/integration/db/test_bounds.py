"""Bounds on the database calls of the worker's and the scheduler's own connections."""

from __future__ import annotations

import socket
import threading
import time

import psycopg
import pytest
from django.db import OperationalError, connection, transaction
from django.test import override_settings

from jobs.db import bounds as dbbounds
from jobs.db.bounds import Bounds, CallTimedOut, StallGuard
from tests.support.concurrency import run_in_threads
from tests.support.polling import wait_for
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db(transaction=True)

BOUNDED = {"DB_STATEMENT_TIMEOUT": 3, "DB_LOCK_TIMEOUT": 1.5, "DB_NETWORK_TIMEOUT": 6}


def show(name: str, using=None) -> str:
    with (using or connection).cursor() as cur:
        cur.execute(f"SHOW {name}")
        return cur.fetchone()[0]


class TestBoundConnections:
    @override_settings(JOBS=BOUNDED)
    def test_only_the_bound_threads_connection_gets_the_timeouts_and_keeps_them(self):
        def thread(index: int) -> tuple[str, str, str]:
            if index == 0:  # a loop thread (the scheduler's, a worker's control thread)
                with dbbounds.bounded() as db:
                    first = show("statement_timeout")
                    db.close()  # a reconnect gets the bounds again
                    return first, show("statement_timeout"), show("lock_timeout")
            # a handler thread of the same process: the project's settings, untouched
            return show("statement_timeout"), show("statement_timeout"), show("lock_timeout")

        loop, handler = run_in_threads(2, thread)
        assert loop == ("3s", "3s", "1500ms")
        assert handler == ("0", "0", "0")
        assert show("statement_timeout") == "0"  # the test's own connection

    @override_settings(JOBS=BOUNDED)
    def test_leaving_bounded_restores_the_plain_connection(self):
        with dbbounds.bounded(connection):
            assert show("lock_timeout") == "1500ms"
        assert show("lock_timeout") == "0"
        assert "options" not in connection.settings_dict["OPTIONS"]

    def test_zero_leaves_a_bound_to_the_server(self):
        jobs = {"DB_STATEMENT_TIMEOUT": 0, "DB_LOCK_TIMEOUT": 0.25}
        with override_settings(JOBS=jobs), dbbounds.bounded():
            assert (show("statement_timeout"), show("lock_timeout")) == ("0", "250ms")

    def test_the_users_own_options_are_kept(self):
        options = {**connection.settings_dict["OPTIONS"], "options": "-c work_mem=8MB"}
        with override_settings(JOBS=BOUNDED):
            params = Bounds.from_settings().libpq_params(options)
        assert params["options"] == "-c work_mem=8MB -c statement_timeout=3000 -c lock_timeout=1500"

    def test_a_transaction_is_not_cut_under_its_feet(self):
        with transaction.atomic(), pytest.raises(RuntimeError, match="inside a transaction"):
            dbbounds.bound(connection)

    @override_settings(JOBS={**BOUNDED, "DB_STATEMENT_TIMEOUT": 0.3})
    def test_a_statement_past_its_bound_is_cancelled(self):
        with dbbounds.bounded() as db, db.cursor() as cur:
            started = time.monotonic()
            with pytest.raises(OperationalError, match="statement timeout"):
                cur.execute("SELECT pg_sleep(20)")
        assert time.monotonic() - started < 5

    @override_settings(JOBS={**BOUNDED, "DB_LOCK_TIMEOUT": 0.3})
    def test_a_wait_for_a_lock_held_elsewhere_gives_up(self):
        holder = psycopg.connect(**dbbounds.connect_params(bounds=Bounds(0, 0, 0)), autocommit=True)
        try:
            holder.execute("SELECT pg_advisory_lock(4242)")
            with (
                dbbounds.bounded() as db,
                db.cursor() as cur,
                pytest.raises(OperationalError, match="lock timeout"),
            ):
                cur.execute("SELECT pg_advisory_lock(4242)")
        finally:
            holder.close()


class TestDedicatedConnections:
    """psycopg connections of their own: the leader's lock session, a NOTIFY listener."""

    @override_settings(JOBS=BOUNDED)
    def test_connect_params_carry_the_statement_bounds(self):
        params = dbbounds.connect_params(application_name="jobs-test")
        with psycopg.connect(**params, autocommit=True) as conn:
            assert conn.execute("SHOW statement_timeout").fetchone()[0] == "3s"
            assert conn.execute("SHOW application_name").fetchone()[0] == "jobs-test"
        assert "cursor_factory" not in params and "context" not in params

    def test_a_dedicated_connection_never_prepares_even_where_the_alias_would(self, monkeypatch):
        """Behind a transaction pooler the next run of a prepared statement lands elsewhere."""
        monkeypatch.setitem(connection.settings_dict["OPTIONS"], "prepare_threshold", 1)
        params = dbbounds.connect_params()
        with psycopg.connect(**params, autocommit=True) as conn:
            for _ in range(10):
                conn.execute("SELECT %s::int", [1])
            prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        assert prepared == (0,)

    @override_settings(JOBS=BOUNDED)
    def test_a_tcp_connection_notices_a_dead_path_through_keepalives_and_user_timeout(self):
        with TcpProxy() as proxy:
            params = {**dbbounds.connect_params(), "host": "127.0.0.1", "port": proxy.port}
            with psycopg.connect(**params, autocommit=True) as conn:
                sock = socket.socket(fileno=conn.pgconn.socket)
                try:
                    tcp = socket.IPPROTO_TCP
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                    assert sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT) == 6000
                    assert sock.getsockopt(tcp, socket.TCP_KEEPIDLE) == 3
                    assert sock.getsockopt(tcp, socket.TCP_KEEPINTVL) == 1
                    assert sock.getsockopt(tcp, socket.TCP_KEEPCNT) == 3
                finally:
                    sock.detach()  # the socket is psycopg's

    def test_network_bounds_off_leave_the_operating_systems_defaults(self):
        params = Bounds(0, 0, 0).libpq_params({})
        assert params == {}


class TestAbortAndDeadline:
    """Where no server or TCP timeout reaches (a silent proxy), the client cuts the call."""

    def test_abort_from_another_thread_ends_a_call_stuck_on_a_silent_path(self):
        with TcpProxy() as proxy:
            params = {**dbbounds.connect_params(), "host": "127.0.0.1", "port": proxy.port}
            conn = psycopg.connect(**params, autocommit=True)
            proxy.freeze()
            outcome: list[BaseException] = []

            def stuck() -> None:
                try:
                    conn.execute("SELECT 1")
                except psycopg.Error as exc:
                    outcome.append(exc)

            caller = threading.Thread(target=stuck)
            caller.start()
            caller.join(0.5)
            assert caller.is_alive()  # no answer comes, and nothing times out by itself
            started = time.monotonic()
            assert dbbounds.abort(conn)
            caller.join(5)
            assert not caller.is_alive() and time.monotonic() - started < 2
            assert isinstance(outcome[0], psycopg.OperationalError)
            assert conn.broken
            conn.close()
        assert not dbbounds.abort(conn)  # closed: nothing to abort

    def test_abort_takes_a_django_connection_too(self):
        connection.ensure_connection()
        assert dbbounds.abort(connection)
        with pytest.raises(OperationalError):
            connection.cursor().execute("SELECT 1")
        connection.close()
        assert not dbbounds.abort(connection)

    def test_a_deadline_aborts_a_call_that_overruns_it(self):
        conn = psycopg.connect(**dbbounds.connect_params(bounds=Bounds(0, 0, 0)), autocommit=True)
        pid = conn.info.backend_pid
        started = time.monotonic()
        with (
            pytest.raises(CallTimedOut, match=r"no answer within 0\.3s"),
            dbbounds.deadline(conn, 0.3),
        ):
            conn.execute("SELECT pg_sleep(20)")
        assert time.monotonic() - started < 3
        conn.close()
        # The server learns of it when the statement ends (statement_timeout bounds that).
        with connection.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])

    def test_a_call_inside_its_deadline_is_left_alone(self):
        conn = psycopg.connect(**dbbounds.connect_params(), autocommit=True)
        with dbbounds.deadline(conn, 0.2):
            assert conn.execute("SELECT 1").fetchone() == (1,)
        time.sleep(0.4)  # past the deadline: the cancelled timer must not fire
        assert conn.execute("SELECT 2").fetchone() == (2,)
        conn.close()


class TestStallGuard:
    def test_it_fires_once_per_stall_and_not_while_the_loop_moves_or_waits(self):
        stalls: list[float] = []
        guard = StallGuard(0.3, stalls.append, check_every=0.02)
        guard.start()
        try:
            deadline = time.monotonic() + 0.8
            while time.monotonic() < deadline:  # a loop that keeps moving
                guard.moved()
                time.sleep(0.02)
            with guard.waiting():  # waiting on purpose is not being stuck
                time.sleep(0.6)  # the wait is the scenario  # noqa: fixed-sleep
            assert stalls == []
            wait_for(lambda: stalls, what="the stall was reported")
            time.sleep(0.5)  # no second report  # noqa: fixed-sleep
            assert len(stalls) == 1 and stalls[0] >= 0.3  # once per stall
            guard.moved()
            wait_for(lambda: len(stalls) == 2, what="a second stall")
        finally:
            guard.stop()

    def test_as_an_execute_wrapper_every_statement_is_a_move(self):
        stalls: list[float] = []
        guard = StallGuard(0.4, stalls.append, check_every=0.02)
        guard.start()
        try:
            with connection.execute_wrapper(guard), connection.cursor() as cur:
                for _ in range(10):
                    cur.execute("SELECT pg_sleep(0.1)")
                assert stalls == []
                cur.execute("SELECT pg_sleep(0.8)")  # one statement past the limit
            assert len(stalls) == 1
        finally:
            guard.stop()
