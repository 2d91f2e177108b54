"""Review round 21: kept bound cursors, handler threads that skip their connection checks, and
the worker's own histograms and running gauge."""

from __future__ import annotations

import threading

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.test import override_settings
from prometheus_client import REGISTRY
from psycopg.pq import TransactionStatus

from jobs.queue import _db
from jobs.worker import metrics
from jobs.worker.execution import close_open_transactions
from jobs.worker.pool import HandlerPool
from tests.support.worker import run_on

pytestmark = pytest.mark.django_db(transaction=True)


# -- handler threads: a connection opened for the thread by a thread it is shared with --------


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


def test_a_connection_opened_by_a_thread_it_is_shared_with_is_still_checked():
    pool = HandlerPool(1)
    try:
        left_open = run_on(pool, _handler_sharing_its_connection)
        autocommit, status = run_on(pool, _starts_clean)
    finally:
        pool.shutdown(5)
    # As before the change: the handler's thread holds a connection out of autocommit, so it
    # is reported and closed, and the next job on the thread does not run (and lose its
    # writes) inside the transaction the previous one left.
    assert left_open == ["default"]
    assert autocommit and status in (None, TransactionStatus.IDLE)


# -- kept bound cursors -------------------------------------------------------------------


def test_a_cursor_kept_after_the_time_zone_changed_during_its_use_loads_as_a_fresh_one():
    sql = "SELECT '2024-01-01 12:00:00+00'::timestamptz"
    changed = override_settings(USE_TZ=False)
    with _db.bound_cursor(None) as cur:  # made while USE_TZ is on: loads aware timestamps
        cur.execute("SELECT 1")
        changed.enable()  # e.g. a test's override entered while a generator holds the cursor
    try:
        with _db.bound_cursor(None) as cur:
            cur.execute(sql)
            [value] = cur.fetchone()
        with connection.cursor() as cur:  # Django's own cursor, for what a fresh one loads
            cur.execute(sql)
            [expected] = cur.fetchone()
    finally:
        changed.disable()
    assert expected.tzinfo is None
    assert value.tzinfo is None, value


def test_a_kept_cursor_does_not_hold_on_to_its_last_result():
    with _db.bound_cursor(None) as cur:
        cur.execute("SELECT repeat('x', %(n)s::integer)", {"n": 5_000_000})  # one 5 MB row
        raw = cur.cursor
    # Closed at the end of its use, the cursor freed its result; kept, it holds it (and the
    # last statement's parameters) until the connection's next use, however big it was.
    assert raw.closed or raw.pgresult is None


def test_threads_sharing_a_connection_never_share_a_bound_cursor():
    with _db.bound_cursor(None) as cur:
        cur.execute("SELECT 1")  # the connection opened, and a cursor kept
    shared = connections[DEFAULT_DB_ALIAS]
    shared.inc_thread_sharing()
    errors: list[BaseException] = []

    def use(offset: int) -> None:
        connections[DEFAULT_DB_ALIAS] = shared  # as Django's LiveServerThread shares one
        try:
            for n in range(200):
                with _db.bound_cursor(None) as cur:
                    cur.execute("SELECT %(v)s::bigint, pg_sleep(0)", {"v": offset + n})
                    assert cur.fetchone()[0] == offset + n
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(k * 1_000,)) for k in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        shared.dec_thread_sharing()
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


# -- the worker's histograms ----------------------------------------------------------------


def test_the_duration_histogram_still_exports_its_created_series():
    name = "review21.created"
    metrics.for_type(name).handler_duration.observe(0.2)
    labels = {"job_type": name}
    # The counters next to it still have theirs (prometheus_client's default)…
    assert REGISTRY.get_sample_value("jobs_claimed_created", labels) is not None
    # …and the library Histogram this replaced exported one for every job type.
    assert REGISTRY.get_sample_value("jobs_handler_duration_seconds_created", labels) is not None
