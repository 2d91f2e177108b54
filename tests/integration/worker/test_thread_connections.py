"""A handler thread that never opened a connection skips the per-job connection checks; one
that did, or whose handler failed, is checked as before, whatever its handlers do."""

from __future__ import annotations

import threading

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.pq import TransactionStatus

from jobs.worker import thread_connections
from jobs.worker.execution import close_open_transactions
from jobs.worker.pool import HandlerPool
from tests.support.worker import run_on

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_thread_that_never_connected_does_not_list_its_connections(monkeypatch):
    asked: list[str] = []
    listed = connections.all

    def counting(*args, **kwargs):
        asked.append(threading.current_thread().name)
        return listed(*args, **kwargs)

    monkeypatch.setattr(connections, "all", counting)
    # An earlier test may have opened a connection shared between threads: then every
    # thread is asked, for good (jobs.worker.thread_connections).
    monkeypatch.setattr(thread_connections, "_shared_opened", False)
    pool = HandlerPool(1)
    try:
        for _ in range(20):  # each as a handler: the open-transaction check, then the recycle
            assert run_on(pool, close_open_transactions) == []
        assert asked == []
        # A handler that failed is checked whatever the thread announced: its check and the
        # recycle after it (done once the next task runs on the one thread), then no more.
        assert run_on(pool, lambda: close_open_transactions(failed=True)) == []
        assert run_on(pool, close_open_transactions) == []
        assert len(asked) == 2, asked
    finally:
        pool.shutdown(5)


STEPS = ("nothing", "query", "autocommit_off", "atomic_left_open", "close", "fail")


def step(kind: str) -> list[str]:
    """One handler doing ``kind`` on this thread's connection, then the worker's check;
    returns what the check found left open. Asserts the thread starts it clean."""
    raw = connection.connection
    if raw is not None and not raw.closed:
        assert connection.get_autocommit() and not connection.in_atomic_block
        assert raw.info.transaction_status == 0  # IDLE: nothing left from a previous job
    if kind in ("query", "autocommit_off", "atomic_left_open", "fail"):
        if kind == "autocommit_off":
            connection.set_autocommit(False)
        if kind == "atomic_left_open":
            transaction.atomic().__enter__()
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
    if kind == "close":
        connection.close()
    return close_open_transactions(failed=kind == "fail")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kinds=st.lists(st.sampled_from(STEPS), min_size=1, max_size=8), max_age=st.sampled_from([0, 60])
)
def test_any_handler_sequence_is_reported_and_leaves_the_thread_clean(kinds, max_age):
    with override_settings(JOBS={"HANDLER_CONN_MAX_AGE": max_age}):
        pool = HandlerPool(1)
    try:
        for kind in kinds:
            left_open = run_on(pool, lambda kind=kind: step(kind))
            expected = ["default"] if kind in ("autocommit_off", "atomic_left_open") else []
            assert left_open == expected, (kinds, kind)
        # The thread ends clean whatever the last handler did.
        run_on(pool, lambda: step("query"))
    finally:
        pool.shutdown(5)


def _handler_sharing_its_connection() -> list[str]:
    """A handler that lends its (not yet opened) connection to a helper thread, which opens
    it and turns autocommit off (work it means to commit later, and never does); then the
    worker's check after the handler, on the handler's thread."""
    conn = connections[DEFAULT_DB_ALIAS]
    conn.inc_thread_sharing()
    try:

        def helper() -> None:
            conn.set_autocommit(False)  # opens the connection here: connection_created fires here
            with conn.cursor() as cur:
                cur.execute("SELECT 1")

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        conn.dec_thread_sharing()
    return close_open_transactions()


def _starts_clean() -> tuple[bool, TransactionStatus | None]:
    """What the next job on the thread finds: autocommit on, no transaction open."""
    raw = connection.connection
    if raw is None:
        return True, None
    return connection.get_autocommit(), raw.info.transaction_status


@pytest.mark.django_db(transaction=True)
def test_a_connection_opened_by_a_thread_it_is_shared_with_is_still_checked():
    pool = HandlerPool(1)
    try:
        left_open = run_on(pool, _handler_sharing_its_connection)
        autocommit, status = run_on(pool, _starts_clean)
    finally:
        pool.shutdown(5)
    # The handler's thread holds a connection out of autocommit, so it
    # is reported and closed, and the next job on the thread does not run (and lose its
    # writes) inside the transaction the previous one left.
    assert left_open == ["default"]
    assert autocommit and status in (None, TransactionStatus.IDLE)
