"""Enqueue costs as few round trips as its guarantees allow.

One job outside any transaction is one statement, with no BEGIN or COMMIT around it; inside
the caller's transaction it adds one statement and no transaction control of its own.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from jobs import queue
from jobs.models import Job
from jobs.queue import NewJob
from tests.support.enqueue import TransactionControl

NAME = "test.noop.v1"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("job_id", [None, "order-1"], ids=["keyless", "keyed"])
def test_one_job_outside_a_transaction_is_one_statement_and_no_transaction(monkeypatch, job_id):
    control = TransactionControl(monkeypatch)

    with CaptureQueriesContext(connection) as statements:
        enqueued = queue.enqueue(NewJob(name=NAME, payload={}, job_id=job_id))

    assert len(statements) == 1, [q["sql"] for q in statements]
    assert control.begun == 0
    assert enqueued.created and Job.objects.get(pk=enqueued.id).state == "queued"


@pytest.mark.django_db(transaction=True)
def test_a_taken_key_outside_a_transaction_finds_its_holder():
    first = queue.enqueue(NewJob(name=NAME, payload={}, job_id="order-2"))

    again = queue.enqueue(NewJob(name=NAME, payload={"other": 1}, job_id="order-2"))

    assert (again.id, again.created) == (first.id, False)
    assert Job.objects.filter(job_id="order-2").count() == 1


@pytest.mark.django_db(transaction=True)
def test_inside_the_callers_transaction_one_job_adds_one_statement(monkeypatch):
    with transaction.atomic():
        control = TransactionControl(monkeypatch)
        with CaptureQueriesContext(connection) as statements:
            queue.enqueue(NewJob(name=NAME, payload={}))
        assert len(statements) == 1, [q["sql"] for q in statements]
        assert control.begun == 0


def prepared_statements() -> list[str]:
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        return [statement for (statement,) in cur.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_one_job_is_a_call_of_the_insert_function_whose_plan_the_server_keeps():
    """The insert is a call of jobs_enqueue_job, planned once a connection (parsing and
    planning the statement cost more than running it), and nothing is prepared by the
    protocol, which a transaction pooler would not keep."""
    with CaptureQueriesContext(connection) as statements:
        for n in range(3):
            queue.enqueue(NewJob(name=NAME, payload={"n": n}))

    assert all(q["sql"].startswith("SELECT jobs_enqueue_job(") for q in statements), statements
    assert prepared_statements() == []
    assert Job.objects.filter(name=NAME, state="queued").count() == 3


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("delay", "notify", "heard"),
    [(None, True, ["test.noop.v1"]), (timedelta(hours=1), True, []), (None, False, [])],
    ids=["due", "later", "notify-off"],
)
def test_one_job_announces_itself_when_due_and_notify_is_on(settings, delay, notify, heard):
    settings.JOBS = {**getattr(settings, "JOBS", {}), "NOTIFY": notify}
    with connection.cursor() as cur:
        cur.execute("LISTEN jobs_enqueued")
    try:
        queue.enqueue(NewJob(name=NAME, payload={}, delay=delay))
        got = [n.payload for n in connection.connection.notifies(timeout=0.3)]
    finally:
        with connection.cursor() as cur:
            cur.execute("UNLISTEN *")
    assert got == heard


def key_lock_probes() -> int:
    """How many times this transaction has searched the key lock index so far."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_get_xact_numscans('jobs_job_key_lock'::regclass)")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("job_id", "probes"), [(None, 0), ("order-3", 1)], ids=["keyless", "keyed"]
)
def test_only_a_job_with_a_key_looks_for_the_keys_holder_first(job_id, probes):
    """A keyless job's key is new by construction: its insert checks nothing before it
    writes (``ON CONFLICT`` searched the key lock index before every insert, about 10 µs of
    server CPU a job). A key a caller chose is looked up first, so a taken one is skipped."""
    with transaction.atomic():
        before = key_lock_probes()
        assert queue.enqueue(NewJob(name=NAME, payload={}, job_id=job_id)).created
        assert key_lock_probes() - before == probes
