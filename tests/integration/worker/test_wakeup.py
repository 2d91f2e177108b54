"""The listener proves that LISTEN delivers with a probe, and sends nothing on its
connection once the probe is out (``jobs.worker.wakeup.NotifyListener._prove``).

The proof asks for the backend before the probe NOTIFY and then only waits. Checked here: a
direct connection proves and wakes at once; a session-mode PgBouncer proves and leaves
nothing on its servers; a transaction-mode PgBouncer with 1, 2 or 5 server connections never
proves, also while other clients keep its pool busy, and each failed proof is undone on the
backend that holds the LISTEN; notices for the worker's job names that come during the proof
(with the backend check's answer or before the probe's) still wake it; the warning is logged
once over many failed proofs; after ``REPROVE_AFTER`` the listener proves again once the
path allows it; a stop during the proof's wait ends the thread at once; a listening backend
lost during the proof, directly or behind the pooler, is survived.

The LISTEN is undone however the proof ends: on a stop during the proof, and on an error
during it (a probe the pooler refuses, ``max_client_conn`` reached), so that no LISTEN stays
on a pooled backend whose notices the pooler would hand to whichever client it lends that
backend to next. The probe is sent from a thread of its own, within the proof's deadline: a
stop or ``PROBE_TIMEOUT`` ends the wait even when the pooler has no free server for the
probe (a session-mode pool of one, which the listener holds) and would keep its
``pg_notify`` queued for ``query_wait_timeout``.

The listener sends no LISTEN at all where the backend that answers is not the one its
connection was opened with, which is so behind PgBouncer in any pool mode
(tests/integration/test_pgbouncer.py). The proof still decides behind a pooler that passes
PostgreSQL's start-up reply through: :func:`_a_pooler_that_passes_the_key_through` plays
one, by taking every connection as the session's own.

Every test runs on real PostgreSQL and a real PgBouncer; waits poll with deadlines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection

from jobs.core.conf import NOTIFY_CHANNEL
from jobs.db import bounds as dbbounds
from jobs.worker import wakeup
from jobs.worker.wakeup import NotifyListener
from tests.support import pgbouncer as pgbouncer_module
from tests.support.pgbouncer import PgBouncer, pgbouncer_fixture, skip_reason  # noqa: F401
from tests.support.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]

PROBE_APP = "jobs-worker listener probe"
LISTENER_APP = "jobs-worker listener"


@pytest.fixture(autouse=True)
def _a_pooler_that_passes_the_key_through(monkeypatch) -> None:
    """The pooler is not told apart before the LISTEN: the probe's proof has to decide."""
    monkeypatch.setattr(wakeup, "_owns_its_session", lambda conn: True)


def _params() -> dict[str, Any]:
    return dbbounds.connect_params(connection)


def _notify(payload: str, params: dict[str, Any] | None = None) -> None:
    with psycopg.connect(**(params or _params()), autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, payload])


def _backend(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jobs.worker" and getattr(r, "action", "") == "listen_unavailable"
    ]


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _skip_without_pgbouncer() -> None:
    if skip_reason():
        pytest.skip(skip_reason())


class Recording(NotifyListener):
    """A listener that records what each proof found and what woke it."""

    def __init__(self, names: tuple[str, ...] = ("x",), **kwargs: Any) -> None:
        self.woken: list[str] = []
        self.proofs: list[bool] = []
        self.undone: list[bool] = []
        self.proving = threading.Event()
        super().__init__(names, self.woken.append, **kwargs)

    def _prove(self, conn, backend, params) -> bool:
        self.proving.set()
        result = super()._prove(conn, backend, params)
        self.proofs.append(result)
        return result

    def _fall_back(self, undone: bool, pooled: bool = False) -> None:
        self.undone.append(undone)
        super()._fall_back(undone, pooled)

    def stop_timed(self, timeout: float = 5.0) -> float:
        started = time.monotonic()
        self.stop(timeout)
        return time.monotonic() - started


def _on_probe(monkeypatch, before: Callable[[int], None]) -> list[int]:
    """Call ``before(n)`` as the n-th probe connection (from 1) is about to open."""
    real = wakeup._connect
    seen: list[int] = []

    def connect(params: dict[str, Any]) -> psycopg.Connection[Any]:
        if params.get("application_name") == PROBE_APP:
            seen.append(len(seen) + 1)
            before(seen[-1])
        return real(params)

    monkeypatch.setattr(wakeup, "_connect", connect)
    return seen


def _terminate(application_name: str) -> int:
    with psycopg.connect(**_params(), autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = current_database()",
            [application_name],
        ).fetchone()
    assert row is not None
    return int(row[0])


# -- direct and session-mode connections prove ---------------------------------------------


def test_a_direct_connection_proves_at_once_and_wakes_on_its_names_only(caplog):
    caplog.set_level(logging.DEBUG, logger="jobs.worker")
    listener = Recording(("x",))
    started = time.monotonic()
    listener.start()
    try:
        wait_for(listener.listening.is_set, what="the proof", interval=0.01)
        # The probe came back: the proof did not wait out PROBE_TIMEOUT.
        assert time.monotonic() - started < wakeup.PROBE_TIMEOUT
        assert listener.proofs == [True] and not listener.unproven.is_set()
        _notify("not-mine")
        _notify("x")
        sent = time.monotonic()
        wait_for(lambda: listener.woken == ["x"], timeout=2, what="the wakeup", interval=0.01)
        assert time.monotonic() - sent < 1.0
    finally:
        assert listener.stop_timed() < 1.0
    assert not listener._thread.is_alive()
    assert _warnings(caplog) == []


def test_a_session_mode_pooler_proves_and_leaves_nothing_behind(caplog):
    _skip_without_pgbouncer()
    caplog.set_level(logging.INFO, logger="jobs.worker")
    with PgBouncer(pool_mode="session", pool_size=3) as session, session.routing():
        listener = Recording(("x",))
        listener.start()
        try:
            wait_for(
                listener.listening.is_set, what="the proof through a session pooler", interval=0.01
            )
            assert listener.proofs == [True]
            with session.connect() as client:  # enqueue's NOTIFY comes through the pooler
                client.execute("SELECT pg_notify(%s, 'x')", [NOTIFY_CHANNEL])
            wait_for(lambda: listener.woken == ["x"], timeout=2, what="the wakeup", interval=0.01)
        finally:
            assert listener.stop_timed() < 1.0
        # The pooler resets the server (DISCARD ALL) once the listener's client is gone.
        wait_for(lambda: session.leftovers() == {}, timeout=5, what="no LISTEN left", interval=0.01)
    assert _warnings(caplog) == []


# -- a transaction-mode pooler never proves ------------------------------------------------


@pytest.mark.parametrize("pool_size", [1, 2, 5])
def test_a_transaction_mode_pooler_never_proves_even_with_a_busy_pool(
    pool_size, monkeypatch, caplog
):
    """Other clients keep every server busy with short transactions, which land on the
    backend that listens and take the probe's notice there: the listener never does."""
    _skip_without_pgbouncer()
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 0.4)
    caplog.set_level(logging.DEBUG, logger="jobs.worker")
    done = threading.Event()
    statements = [0]
    errors: list[BaseException] = []
    with PgBouncer(pool_size=pool_size) as bouncer:

        def busy() -> None:
            try:
                with bouncer.connect() as client:
                    while not done.is_set():
                        with client.transaction():
                            client.execute("SELECT pg_backend_pid(), pg_sleep(0.002)")
                        statements[0] += 1
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        clients = [threading.Thread(target=busy) for _ in range(2)]
        for client in clients:
            client.start()
        try:
            wait_for(lambda: statements[0] > 20, what="a busy pool", interval=0.01)
            listener = Recording(("x",))
            with bouncer.routing():
                outcomes = [listener._listen() for _ in range(3)]
        finally:
            done.set()
            for client in clients:
                client.join(10)
        assert not errors
        assert outcomes == [False, False, False] and listener.proofs == [False] * 3
        assert not listener.listening.is_set() and listener.unproven.is_set()
        assert listener.undone == [True, True, True]
        assert bouncer.leftovers() == {}
    assert len(_warnings(caplog)) == 1
    assert len(_messages(caplog, "still delivers no notifications")) == 2


def test_the_warning_is_logged_once_over_many_failed_proofs(monkeypatch, caplog):
    _skip_without_pgbouncer()
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 0.3)
    monkeypatch.setattr(wakeup, "REPROVE_AFTER", 0.05)
    caplog.set_level(logging.DEBUG, logger="jobs.worker")
    with PgBouncer(pool_size=2) as bouncer, bouncer.routing():
        listener = Recording(("x",), poll_interval=0.7)
        real_fall_back = listener._fall_back

        def fall_back(undone: bool, pooled: bool = False) -> None:
            real_fall_back(undone, pooled)
            if len(listener.undone) == 4:  # park the loop in its wait: stop ends no proof
                wakeup.REPROVE_AFTER = 60.0

        listener._fall_back = fall_back  # type: ignore[method-assign]
        listener.start()
        try:
            wait_for(lambda: len(listener.undone) >= 4, what="four failed proofs", interval=0.01)
        finally:
            assert listener.stop_timed() < 1.0
        assert listener.undone == [True] * 4 and not listener.listening.is_set()
        assert bouncer.leftovers() == {}
    [warning] = _warnings(caplog)
    assert "0.7s" in warning and "--no-listen" in warning and "server_lifetime" not in warning
    assert len(_messages(caplog, "still delivers no notifications")) == 3


def test_after_reprove_after_the_listener_proves_once_the_path_allows_it(monkeypatch, caplog):
    """Behind a transaction-mode pooler first; then the alias points at PostgreSQL again."""
    _skip_without_pgbouncer()
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 0.3)
    monkeypatch.setattr(wakeup, "REPROVE_AFTER", 0.2)
    caplog.set_level(logging.INFO, logger="jobs.worker")
    with PgBouncer(pool_size=2) as bouncer:
        listener = Recording(("x",))
        with bouncer.routing():
            listener.start()
            try:
                wait_for(listener.unproven.is_set, what="the failed proof", interval=0.01)
            except BaseException:
                listener.stop()
                raise
        try:
            wait_for(
                listener.listening.is_set, what="the reproof on a direct connection", interval=0.01
            )
            assert not listener.unproven.is_set()
            assert listener.proofs[-1] is True and False in listener.proofs
            _notify("x")
            wait_for(lambda: listener.woken == ["x"], timeout=2, what="the wakeup", interval=0.01)
            assert bouncer.leftovers() == {}
        finally:
            assert listener.stop_timed() < 1.0
    assert len(_warnings(caplog)) == 1
    assert len(_messages(caplog, "LISTEN delivers notifications again")) == 1


# -- notices during the proof --------------------------------------------------------------


def test_names_notified_during_the_proof_wake_the_worker(monkeypatch):
    """One comes with the answer to the backend check, one just before the probe's."""
    real_backend = wakeup._backend
    calls: list[int] = []

    def backend(conn: psycopg.Connection[Any]) -> int:
        calls.append(1)
        if len(calls) == 2:  # the proof's check, after the LISTEN has committed
            _notify("y")
        return real_backend(conn)

    monkeypatch.setattr(wakeup, "_backend", backend)
    _on_probe(monkeypatch, lambda n: _notify("x"))
    listener = Recording(("x", "y"))
    listener.start()
    try:
        wait_for(listener.listening.is_set, what="the proof", interval=0.01)
        # Both came before the probe's notice, so both were handled within the proof.
        assert sorted(listener.woken) == ["x", "y"]
        assert listener.proofs == [True]
    finally:
        assert listener.stop_timed() < 1.0


# -- stops and losses during the proof -----------------------------------------------------


def _stop_during_the_wait(monkeypatch, bouncer: PgBouncer) -> Recording:
    """A listener behind a pool of one, stopped while its proof waits for the probe."""
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 30.0)
    probed = threading.Event()
    _on_probe(monkeypatch, lambda n: probed.set())
    listener = Recording(("x",))
    with bouncer.routing():
        listener.start()
        try:
            wait_for(probed.is_set, what="the probe", interval=0.01)
            # The probe ran on the one server, which gave its notice to the probe itself:
            # the proof now waits for one that never comes.
            wait_for(lambda: not _probe_connected(bouncer), what="the probe closed", interval=0.01)
        finally:
            listener.elapsed = listener.stop_timed()  # type: ignore[attr-defined]
    return listener


def _probe_connected(bouncer: PgBouncer) -> bool:
    return any(row["application_name"] == PROBE_APP for row in bouncer.show("CLIENTS"))


def test_a_stop_during_the_proof_returns_at_once(monkeypatch):
    _skip_without_pgbouncer()
    with PgBouncer(pool_size=1) as single:
        listener = _stop_during_the_wait(monkeypatch, single)
        assert listener.elapsed < 1.0  # type: ignore[attr-defined]
        assert not listener._thread.is_alive()
        assert listener.proofs == [False] and not listener.listening.is_set()


def test_a_stop_during_the_proof_leaves_no_listen_on_a_pooled_backend(monkeypatch):
    _skip_without_pgbouncer()
    with PgBouncer(pool_size=1) as single:
        listener = _stop_during_the_wait(monkeypatch, single)
        assert not listener._thread.is_alive()
        assert single.leftovers() == {}


def test_a_probe_that_cannot_connect_leaves_no_listen_on_a_pooled_backend(monkeypatch, caplog):
    _skip_without_pgbouncer()
    caplog.set_level(logging.INFO, logger="jobs.worker")
    # Room for two clients: the listener's connection and one other that stays connected.
    monkeypatch.setattr(pgbouncer_module, "MAX_CLIENTS", 2)
    with PgBouncer(pool_size=1) as single:
        listener = Recording(("x",))
        failed = threading.Event()
        real_warning = wakeup.logger.warning

        def warning(message: str, *args: Any, **kwargs: Any) -> None:
            real_warning(message, *args, **kwargs)
            if message.startswith("LISTEN connection failed"):
                failed.set()

        monkeypatch.setattr(wakeup.logger, "warning", warning)
        # An idle client holds a client slot, not a server.
        with single.connect(), single.routing():
            listener.start()
            try:
                wait_for(failed.is_set, what="the probe refused", interval=0.01)
            finally:
                listener.stop()
        assert not listener._thread.is_alive()
        assert any("max_client_conn" in m for m in _messages(caplog, "connection failed"))
        assert single.leftovers() == {}


def test_a_stop_while_the_probe_waits_for_a_server_returns_promptly():
    _skip_without_pgbouncer()
    with PgBouncer(pool_mode="session", pool_size=1) as single:

        def waiting() -> int:
            return sum(
                int(row["cl_waiting"])
                for row in single.show("POOLS")
                if row["database"] == single.dbname
            )

        listener = Recording(("x",))
        with single.routing():
            listener.start()
            try:
                wait_for(
                    lambda: waiting() >= 1, what="the probe waiting for a server", interval=0.01
                )
            finally:
                elapsed = listener.stop_timed(timeout=1.5)
        alive = listener._thread.is_alive()
        # Clean up: the listener's backend ends, its server goes to the probe, which ends.
        _terminate(LISTENER_APP)
        wait_for(lambda: not listener._thread.is_alive(), what="the thread gone", interval=0.01)
    assert not alive and elapsed < 1.0


def test_a_direct_listening_connection_lost_during_the_proof_proves_again(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="jobs.worker")
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 30.0)
    killed: list[int] = []
    _on_probe(monkeypatch, lambda n: killed.append(_terminate(LISTENER_APP)) if n == 1 else None)
    listener = Recording(("x",))
    started = time.monotonic()
    listener.start()
    try:
        wait_for(listener.listening.is_set, what="the second proof", interval=0.01)
        assert killed == [1]
        assert time.monotonic() - started < 5.0  # the loss ended the proof, not its timeout
        _notify("x")
        wait_for(lambda: listener.woken == ["x"], timeout=2, what="the wakeup", interval=0.01)
    finally:
        assert listener.stop_timed() < 1.0
    assert listener.proofs == [True]  # the first raised out of the wait
    assert len(_messages(caplog, "LISTEN connection failed")) == 1
    assert _warnings(caplog) == []


def test_the_listening_backend_lost_during_the_proof_behind_the_pooler(monkeypatch, caplog):
    """The backend that holds the LISTEN dies: nothing to undo, nothing left, no proof."""
    _skip_without_pgbouncer()
    caplog.set_level(logging.INFO, logger="jobs.worker")
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 0.5)
    with PgBouncer(pool_size=1) as single:
        before = {row["remote_pid"] for row in single.show("SERVERS")}
        direct = _params()  # to PostgreSQL itself, not through the pooler

        def kill(n: int) -> None:
            with psycopg.connect(**direct, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = ANY(%s)",
                    [list(before)],
                )
            # The pooler has seen its server go before the probe asks it for one.
            wait_for(
                lambda: not before & {row["remote_pid"] for row in single.show("SERVERS")},
                what="the pooler rid of the dead server",
                interval=0.01,
            )

        _on_probe(monkeypatch, kill)
        listener = Recording(("x",))
        with single.routing():
            assert listener._listen() is False
        assert listener.proofs == [False] and listener.undone == [False]
        assert listener.unproven.is_set() and not listener.listening.is_set()
        assert single.leftovers() == {}
    [warning] = _warnings(caplog)
    assert "server_lifetime" in warning


@pytest.fixture(autouse=True)
def _no_stopped_listener_left() -> Iterator[None]:
    """A listener thread a test left running would send notices into the next test."""
    before = {t for t in threading.enumerate() if t.name == "jobs-listener"}
    yield
    wait_for(
        lambda: not {t for t in threading.enumerate() if t.name == "jobs-listener"} - before,
        timeout=10,
        what="every listener thread ended",
        interval=0.01,
    )
