"""A large batch of keyless jobs goes in by COPY, and lands as the INSERT statement puts it.

Keyless jobs have random keys, so a batch of them skips nothing and needs no ``ON CONFLICT``:
from ``COPY_AT_LEAST`` jobs on, enqueue writes them with COPY and computes in Python what the
statement computed per row (the due time from one clock, the tenant-ordered flag). These tests
hold the two paths to the same rows, the same ids in input order and the same notices.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import FlowGate, Job
from jobs.queue import NewJob
from tests.support.enqueue import COLUMNS

enqueue_module = importlib.import_module("jobs.queue.enqueue")
COPY_AT_LEAST = enqueue_module.COPY_AT_LEAST
NAMES = ("copy.a.v1", "copy.b.v1")

pytestmark = pytest.mark.django_db(transaction=True)


def stored(results) -> list[tuple]:
    rows = {job.pk: job for job in Job.objects.filter(pk__in=[r.id for r in results])}
    out = []
    for result in results:
        job = rows[result.id]
        due_in = (job.run_after - job.created_at).total_seconds()
        out.append((*(getattr(job, c) for c in COLUMNS), round(due_in, 3)))
    return out


def batch(size: int, draw=None) -> list[NewJob]:
    jobs = []
    for n in range(size):
        if draw is None:
            name, delay, priority, tenant = NAMES[n % 2], None, 0, None
        else:
            name, delay, priority, tenant = draw(n)
        jobs.append(
            NewJob(
                name,
                {"n": n, "text": "é\u2603"},
                delay=delay,
                priority=priority,
                tenant=tenant,
            )
        )
    return jobs


def test_a_large_keyless_batch_is_copied_and_its_ids_follow_the_input_order():
    with CaptureQueriesContext(connection) as statements:
        results = queue.enqueue_many(batch(COPY_AT_LEAST))

    assert any(q["sql"].startswith("COPY jobs_job") for q in statements), statements
    assert all(r.created for r in results)
    assert [r.id for r in results] == sorted(r.id for r in results)
    assert Job.objects.filter(state="queued").count() == COPY_AT_LEAST


def test_a_smaller_or_keyed_batch_is_inserted_by_the_statement():
    keyed = [NewJob(NAMES[0], {"n": n}, job_id=f"k{n}") for n in range(COPY_AT_LEAST)]
    for jobs in (batch(COPY_AT_LEAST - 1), keyed):
        with CaptureQueriesContext(connection) as statements:
            queue.enqueue_many(jobs)
        assert not any(q["sql"].startswith("COPY") for q in statements)


def test_a_copied_batch_rolls_back_with_the_callers_transaction():
    with pytest.raises(RuntimeError), transaction.atomic():
        queue.enqueue_many(batch(COPY_AT_LEAST))
        assert Job.objects.count() == COPY_AT_LEAST
        raise RuntimeError("the business write failed")
    assert Job.objects.count() == 0


def test_a_copied_batch_announces_each_due_name_once_after_commit():
    jobs = [*batch(COPY_AT_LEAST), NewJob("copy.later.v1", {}, delay=timedelta(hours=1))]
    with connection.cursor() as cur:
        cur.execute("LISTEN jobs_enqueued")
    try:
        queue.enqueue_many(jobs)
        heard = [n.payload for n in connection.connection.notifies(timeout=0.3)]
    finally:
        with connection.cursor() as cur:
            cur.execute("UNLISTEN *")
    assert sorted(heard) == sorted(NAMES)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    size=st.integers(COPY_AT_LEAST, COPY_AT_LEAST + 40),
    fair=st.sets(st.sampled_from(NAMES)),
)
def test_copied_rows_are_the_rows_the_statement_inserts(monkeypatch, data, size, fair):
    """Any batch (names, delays past and future, priorities, tenants, tenant-ordered types):
    copied, it stores what the INSERT statement stores, position by position."""
    Job.objects.all().delete()
    FlowGate.objects.all().delete()
    for name in fair:
        FlowGate.objects.create(name=name, tenant_ordered=True)
    delays = st.one_of(st.none(), st.integers(-3600, 3600).map(lambda s: timedelta(seconds=s)))
    picks = [
        (
            data.draw(st.sampled_from(NAMES)),
            data.draw(delays),
            data.draw(st.integers(-100, 100)),
            data.draw(st.sampled_from([None, "acme", "globex"])),
        )
        for _ in range(size)
    ]
    jobs = batch(size, lambda n: picks[n])

    copied = stored(queue.enqueue_many(jobs))
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted = stored(queue.enqueue_many(jobs))
    monkeypatch.undo()

    assert copied == inserted


def test_jobs_given_a_due_time_keep_it():
    at = timezone.now() + timedelta(minutes=5)
    jobs = [NewJob(NAMES[0], {"n": n}, run_after=at) for n in range(COPY_AT_LEAST)]
    results = queue.enqueue_many(jobs)
    assert set(
        Job.objects.filter(pk__in=[r.id for r in results]).values_list("run_after", flat=True)
    ) == {at}


class Recorded(dict):
    """A payload that notes when enqueue encodes it (the JSON encoder asks for its items)."""

    encoded: list[int] = []  # shared on purpose: one log for a batch

    def items(self):
        Recorded.encoded.append(self["n"])
        return super().items()


def enqueue_noting_checks_at_copy(jobs: list[NewJob]) -> list[int]:
    """Enqueue ``jobs``; how many of their payloads had been encoded when each COPY began."""
    checked_at_copy: list[int] = []

    def note(execute, sql, params, many, context):
        if sql.startswith("COPY"):
            checked_at_copy.append(len(Recorded.encoded))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(note):
        queue.enqueue_many(jobs)
    return checked_at_copy


def test_the_copy_starts_while_the_batch_is_still_being_validated():
    """The rows stream to the server while later jobs are checked, so its work on them
    overlaps the client's instead of following it."""
    Recorded.encoded = []
    jobs = [NewJob(NAMES[0], Recorded(n=n)) for n in range(COPY_AT_LEAST * 4)]
    checked_at_copy = enqueue_noting_checks_at_copy(jobs)

    assert checked_at_copy and checked_at_copy[0] < len(jobs), checked_at_copy
    assert sorted(Recorded.encoded) == list(range(len(jobs)))  # each job checked once
    assert Job.objects.count() == len(jobs)


@pytest.mark.parametrize("bad_at", [0, COPY_AT_LEAST * 2, COPY_AT_LEAST * 4 - 1])
def test_an_invalid_job_of_a_large_batch_leaves_the_callers_transaction_usable(bad_at):
    jobs = batch(COPY_AT_LEAST * 4)
    jobs[bad_at] = NewJob(NAMES[0], {"n": float("nan")})
    with transaction.atomic():
        queue.enqueue_many(batch(3))  # the caller's own write, before
        with pytest.raises(queue.InvalidJob, match="payload is not JSON") as raised:
            queue.enqueue_many(jobs)
        assert raised.value.index == bad_at
        queue.enqueue_many(batch(2))  # and after: the transaction goes on
    assert Job.objects.count() == 5


def test_an_invalid_job_found_during_the_copy_inserts_nothing_outside_a_transaction():
    jobs = batch(COPY_AT_LEAST * 4)
    jobs[-1] = NewJob(NAMES[0], {"n": 1}, priority=10**6)
    with pytest.raises(queue.InvalidJob, match="priority") as raised:
        queue.enqueue_many(jobs)
    assert raised.value.index == len(jobs) - 1
    assert Job.objects.count() == 0
    assert connection.get_autocommit() and not connection.in_atomic_block


def test_inside_the_callers_transaction_a_batch_is_checked_whole_before_any_statement():
    """No savepoint, so no subtransaction in the caller's transaction (past 64 of them every
    snapshot on the server slows down), and nothing is sent for a batch that is refused."""
    Recorded.encoded = []
    jobs = [NewJob(NAMES[0], Recorded(n=n)) for n in range(COPY_AT_LEAST * 2)]
    bad = [*batch(COPY_AT_LEAST * 2), NewJob(NAMES[0], {"n": float("inf")})]
    with transaction.atomic():
        with CaptureQueriesContext(connection) as refused, pytest.raises(queue.InvalidJob):
            queue.enqueue_many(bad)
        with CaptureQueriesContext(connection) as copied:
            checked_at_copy = enqueue_noting_checks_at_copy(jobs)

    assert refused.captured_queries == []
    assert checked_at_copy == [len(jobs)]
    assert not any("SAVEPOINT" in q["sql"] for q in copied.captured_queries), copied
    assert Job.objects.count() == len(jobs)


def test_with_autocommit_off_a_batch_is_checked_whole_as_inside_atomic():
    """A transaction the caller opened by turning autocommit off is the caller's too: no
    savepoint, and nothing is sent for a batch that is refused."""
    bad = [*batch(COPY_AT_LEAST * 2), NewJob(NAMES[0], {"n": float("nan")})]
    transaction.set_autocommit(False)
    try:
        with CaptureQueriesContext(connection) as refused, pytest.raises(queue.InvalidJob):
            queue.enqueue_many(bad)
        with CaptureQueriesContext(connection) as copied:
            queue.enqueue_many(batch(COPY_AT_LEAST))
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert refused.captured_queries == []
    assert not any("SAVEPOINT" in q["sql"] for q in copied.captured_queries), copied
    assert Job.objects.count() == COPY_AT_LEAST


@pytest.mark.parametrize(
    "size, inside", [(COPY_AT_LEAST, False), (COPY_AT_LEAST, True), (5, False), (5, True)]
)
def test_a_batch_of_keyless_jobs_draws_its_random_ids_at_once(monkeypatch, size, inside):
    """Each keyless job's id has 74 random bits: read from the system once a batch (one
    call), not once a job (a third of drawing an id, 0.3 µs of a bulk enqueue's 10)."""
    calls = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: calls.append(n) or real(n))
    keyed = [NewJob(NAMES[0], {"n": -n}, job_id=f"key-{n}") for n in range(1, 3)]
    with transaction.atomic() if inside else contextlib.nullcontext():
        results = queue.enqueue_many([*batch(size), *([] if size >= COPY_AT_LEAST else keyed)])

    assert len(calls) == 1, calls
    assert len({r.job_id for r in results}) == len(results)
    assert Job.objects.count() == len(results)


@pytest.mark.parametrize("inside", [False, True])
def test_a_large_keyless_batch_works_out_its_database_once(monkeypatch, inside):
    """The alias a batch goes to is one lookup a type, but a pass over every job. Inside the
    caller's transaction a batch used to work it out, find the transaction open and take the
    general path, which worked it out again and built every result twice."""
    calls = []
    real = enqueue_module.databases.route
    monkeypatch.setattr(
        enqueue_module.databases, "route", lambda jobs, using: calls.append(1) or real(jobs, using)
    )
    with transaction.atomic() if inside else contextlib.nullcontext():
        results = queue.enqueue_many(batch(COPY_AT_LEAST * 2))

    assert len(calls) == 1
    assert [r.id for r in results] == sorted(r.id for r in results)
    assert Job.objects.count() == COPY_AT_LEAST * 2
