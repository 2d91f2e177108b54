"""A job enqueued on its own goes in through ``jobs_enqueue_job``, a function of its own; a
batch goes in through one multi-row statement. Whichever way it goes, the row is the same.

Two sessions enqueuing one key leave one row and report ``created`` once; sessions meeting
an expired key holder at once insert one row and all return it; the single insert
announces only an inserted, due job, only with NOTIFY on, and only at commit; its due time
is its delay after its creation with ``USE_TZ = False`` too; migrating back and forward
with prepared calls leaves the queue working.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.core.conf import NOTIFY_CHANNEL
from jobs.models import FlowGate, Job
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    OutcomeReport,
)
from tests.support.concurrency import Background
from tests.support.enqueue import COLUMNS
from tests.support.noop_jobs import NAME, claim
from tests.support.prepared import queue_prepares

NAMES = ("one.a.v1", "one.b.v1")

pytestmark = pytest.mark.django_db(transaction=True)

keys = itertools.count()
# Text the database stores (no NUL, no lone surrogate): payloads' checks are tested elsewhere.
WORDS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")


def stored(enqueued: queue.Enqueued, job: NewJob) -> tuple:
    """The row's columns; its due time as given, or as an offset from its creation."""
    row = Job.objects.get(pk=enqueued.id)
    due = (
        row.run_after
        if job.run_after
        else round((row.run_after - row.created_at).total_seconds(), 3)
    )
    return (*(getattr(row, c) for c in COLUMNS), due)


def alone(job: NewJob) -> queue.Enqueued:
    return queue.enqueue(job)


def alone_in_a_transaction(job: NewJob) -> queue.Enqueued:
    with transaction.atomic():
        return queue.enqueue(job)


def first_of_a_batch(job: NewJob) -> queue.Enqueued:
    return queue.enqueue_many([job, NewJob(NAMES[0], {})])[0]


WAYS = (alone, alone_in_a_transaction, first_of_a_batch)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(NAMES),
    fair=st.sets(st.sampled_from(NAMES)),
    when=st.one_of(
        st.none(),
        st.integers(-3600, 3600).map(lambda s: {"delay": timedelta(seconds=s)}),
        st.integers(-3600, 3600).map(
            lambda s: {"run_after": timezone.now().replace(microsecond=0) + timedelta(seconds=s)}
        ),
    ),
    priority=st.integers(-100, 100),
    tenant=st.sampled_from([None, "acme"]),
    keyed=st.booleans(),
    max_attempts=st.one_of(st.none(), st.integers(1, 50)),
    payload=st.dictionaries(
        st.text(WORDS, max_size=5), st.integers() | st.text(WORDS, max_size=5), max_size=3
    ),
)
def test_a_job_on_its_own_is_stored_as_in_a_batch(
    name, fair, when, priority, tenant, keyed, max_attempts, payload
):
    """Any job (tenant-ordered type or not, due now, later, earlier or at a given time, with
    or without a key): enqueued alone, alone in the caller's transaction, or in a batch, it
    is stored alike."""
    FlowGate.objects.all().delete()
    for tenant_ordered in fair:
        FlowGate.objects.create(name=tenant_ordered, tenant_ordered=True)

    def job() -> NewJob:
        return NewJob(
            name,
            payload,
            priority=priority,
            tenant=tenant,
            max_attempts=max_attempts,
            job_id=f"key-{next(keys)}" if keyed else None,
            **(when or {}),
        )

    rows = []
    for way in WAYS:
        made = job()
        enqueued = way(made)
        assert enqueued.created and enqueued.state == "queued"
        rows.append(stored(enqueued, made))
    assert rows[0] == rows[1] == rows[2]
    assert rows[0][COLUMNS.index("fair")] == (name in fair)


@pytest.mark.django_db(transaction=True)
def test_one_job_after_set_autocommit_false_stays_in_the_callers_transaction():
    transaction.set_autocommit(False)
    try:
        queue.enqueue(NewJob(name=NAME, payload={}))
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_one_keyed_job_outside_a_transaction_releases_an_expired_holder():
    first = queue.enqueue(NewJob(name=NAME, payload={}, job_id="order-x"))
    [job] = claim(1)
    queue.record([Outcome.succeeded(job)])
    Job.objects.filter(pk=first.id).update(finished_at=datetime(2000, 1, 1, tzinfo=UTC))

    again = queue.enqueue(NewJob(name=NAME, payload={"n": 2}, job_id="order-x"))

    assert again.created and again.id != first.id
    assert Job.objects.get(pk=first.id).key_held is False
    assert Job.objects.get(pk=again.id).payload == {"n": 2}


JOB_NAME = "test.job.v1"


# Nothing is ever queued under these: a pass that writes outcomes and claims nothing.
IDLE = "test.job.idle.v1"


SCOPE = AllTenants()


def claim_job(limit: int = 1) -> list[queue.ClaimedJob]:
    return queue.claim([ClaimRequest(JOB_NAME, limit)], scope=SCOPE, worker="w27")


def pass_once(batch: list[Outcome]) -> OutcomeReport:
    """The worker's pass function (no check of the text sent: prepared, it is not logged)."""
    report, claimed = queue.record_and_claim(
        batch, [ClaimRequest(IDLE, 3)], scope=SCOPE, count=False
    )
    assert claimed == []
    return report


def _someone_waits_for_a_lock(deadline: float = 10.0) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cur.fetchone()[0]:
                return True
        time.sleep(0.01)
    return False


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("second", ["alone", "in a transaction"])
def test_two_sessions_enqueuing_one_key_leave_one_row(end, second):
    """The first session's insert is not committed yet when the second enqueues the same
    key: the second waits, then returns the first's row (commit) or inserts its own
    (rollback). One key-holding row either way, ``created`` reported once."""
    inserted, finish = threading.Event(), threading.Event()

    def first() -> queue.Enqueued:
        with transaction.atomic():
            enqueued = queue.enqueue(NewJob(JOB_NAME, {"who": 1}, job_id="race"))
            inserted.set()
            assert finish.wait(20)
            transaction.set_rollback(end == "rollback")
        return enqueued

    def other() -> queue.Enqueued:
        if second == "alone":
            return queue.enqueue(NewJob(JOB_NAME, {"who": 2}, job_id="race"))
        with transaction.atomic():
            return queue.enqueue(NewJob(JOB_NAME, {"who": 2}, job_id="race"))

    a = Background(first)
    assert inserted.wait(20)
    b = Background(other)
    assert _someone_waits_for_a_lock()
    finish.set()
    ours, theirs = a.result(), b.result()
    [(id_, payload)] = Job.objects.filter(job_id="race", key_held=True).values_list("id", "payload")
    assert theirs.id == id_
    if end == "commit":
        assert (ours.created, theirs.created, payload) == (True, False, {"who": 1})
        assert ours.id == id_
    else:
        assert (theirs.created, payload) == (True, {"who": 2})
        assert Job.objects.filter(job_id="race").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "in a transaction"])
def test_sessions_meeting_an_expired_key_holder_at_once_insert_one_row(inside):
    old = queue.enqueue(NewJob(JOB_NAME, {"old": True}, job_id="expired"))
    Job.objects.filter(pk=old.id).update(
        state="failed", finished_at=timezone.now() - timedelta(days=3650)
    )
    sessions = 6
    barrier = threading.Barrier(sessions)

    def enqueue() -> queue.Enqueued:
        barrier.wait(20)
        if inside:
            with transaction.atomic():
                return queue.enqueue(NewJob(JOB_NAME, {}, job_id="expired"))
        return queue.enqueue(NewJob(JOB_NAME, {}, job_id="expired"))

    results = [r.result() for r in [Background(enqueue) for _ in range(sessions)]]
    [holder] = Job.objects.filter(job_id="expired", key_held=True).values_list("id", flat=True)
    assert {r.id for r in results} == {holder} and holder != old.id
    assert sum(r.created for r in results) == 1
    assert Job.objects.filter(job_id="expired").count() == 2


def _heard(timeout: float = 0.3) -> list[str]:
    return [n.payload for n in connection.connection.notifies(timeout=timeout)]


@pytest.mark.django_db(transaction=True)
def test_the_single_insert_announces_only_an_inserted_due_job_with_notify_on(settings):
    queue.enqueue(NewJob(JOB_NAME, {}, job_id="held"))
    with connection.cursor() as cur:
        cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
    try:
        _heard(0.05)
        queue.enqueue(NewJob(JOB_NAME, {}))
        assert _heard() == [JOB_NAME]
        queue.enqueue(NewJob(JOB_NAME, {}, job_id="held"))  # its key is held: nothing inserted
        queue.enqueue(NewJob(JOB_NAME, {}, delay=timedelta(seconds=30)))  # not due
        queue.enqueue(NewJob(JOB_NAME, {}, run_after=timezone.now() + timedelta(seconds=30)))
        assert _heard() == []
        queue.enqueue(NewJob(JOB_NAME, {}, run_after=timezone.now() - timedelta(days=1)))
        assert _heard() == [JOB_NAME]
        with transaction.atomic():
            queue.enqueue(NewJob(JOB_NAME, {}))
            transaction.set_rollback(True)
        assert _heard() == []
        with transaction.atomic():
            queue.enqueue(NewJob(JOB_NAME, {}, job_id="in a transaction"))
        assert _heard() == [JOB_NAME]
        settings.JOBS = {**getattr(settings, "JOBS", {}), "NOTIFY": False}
        queue.enqueue(NewJob(JOB_NAME, {}))
        assert _heard() == []
    finally:
        with connection.cursor() as cur:
            cur.execute("UNLISTEN *")


@pytest.mark.django_db(transaction=True)
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "in a transaction"])
@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_with_use_tz_off_a_single_job_is_due_its_delay_after_its_creation(inside, keyed):
    connection.close()  # the time zone is read at connect
    job = NewJob(JOB_NAME, {}, delay=timedelta(hours=1), job_id="tz" if keyed else None)
    if inside:
        with transaction.atomic():
            enqueued = queue.enqueue(job)
    else:
        enqueued = queue.enqueue(job)
    with connection.cursor() as cur:
        cur.execute("SELECT run_after - created_at FROM jobs_job WHERE id = %s", [enqueued.id])
        assert cur.fetchone() == (timedelta(hours=1),)
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_single_waiting_job_in_a_rolled_back_transaction_leaves_nothing():
    upstream = queue.enqueue(NewJob(JOB_NAME, {}))
    with transaction.atomic():
        waiting = queue.enqueue(NewJob(JOB_NAME, {}, after=(upstream.id,)))
        assert Job.objects.get(pk=waiting.id).waiting_on == 1
        transaction.set_rollback(True)
    assert list(Job.objects.values_list("id", flat=True)) == [upstream.id]
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM jobs_dependency")
        assert cur.fetchone() == (0,)


@pytest.mark.django_db(transaction=True)
def test_migrating_back_to_0001_and_forward_with_prepared_calls_leaves_the_queue_working():
    """``JOBS["PREPARED_STATEMENTS"]``: the call of ``jobs_enqueue_job`` and the pass are prepared
    on this connection; the functions are dropped (``migrate jobs 0001``) and made anew on
    it. Every later call answers."""
    with queue_prepares(True):
        assert queue.enqueue(NewJob(NAME, {})).created
        assert queue.enqueue(NewJob(NAME, {}, job_id="prepared")).created
        pass_once([])
        try:
            call_command("migrate", "jobs", "0001", verbosity=0)
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT proname FROM pg_proc "
                    "WHERE proname IN ('jobs_enqueue_job', 'jobs_worker_pass_v3')"
                )
                assert cur.fetchall() == []
        finally:
            call_command("migrate", "jobs", verbosity=0)
        for n in range(3):
            assert queue.enqueue(NewJob(NAME, {"n": n})).created
        assert not queue.enqueue(NewJob(NAME, {}, job_id="prepared")).created
        [job] = claim(1)
        assert pass_once([Outcome.succeeded(job)]).applied == (job.id,)
