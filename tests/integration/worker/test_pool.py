"""Handler threads keep a healthy connection between jobs and drop broken or dirty ones."""

from __future__ import annotations

import queue

import pytest
from django.db import connection
from django.test import override_settings

from jobs.worker.pool import HandlerPool

pytestmark = pytest.mark.django_db(transaction=True)


def backend_pids(pool: HandlerPool, jobs: list) -> list[int]:
    """Run each job on the pool, one at a time; each returns its connection's backend pid."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    pids = []
    for job in jobs:
        pool.submit(lambda job=job: results.put(job()))
        pids.append(results.get(timeout=10))
    return pids


def pid() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


def leave_transaction_open() -> int:
    connection.set_autocommit(False)
    return pid()


def test_a_thread_reuses_its_connection_between_jobs():
    pool = HandlerPool(1)
    try:
        first, second = backend_pids(pool, [pid, pid])
    finally:
        pool.shutdown(5)
    assert first == second


@override_settings(JOBS={"HANDLER_CONN_MAX_AGE": 0})
def test_max_age_zero_connects_for_every_job():
    pool = HandlerPool(1)
    try:
        first, second = backend_pids(pool, [pid, pid])
    finally:
        pool.shutdown(5)
    assert first != second


def test_a_connection_left_in_a_transaction_is_closed():
    pool = HandlerPool(1)
    try:
        first, second = backend_pids(pool, [leave_transaction_open, pid])
    finally:
        pool.shutdown(5)
    assert first != second
