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
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import enqueue_many, queue
from jobs.catalogue import routing
from jobs.catalogue.registry import Registry, catalogue, get_registry
from jobs.core.conf import NOTIFY_CHANNEL
from jobs.models import FlowGate, Job
from jobs.queue import InvalidJob, NewJob, text
from tests.dbapp.types import OTHER, ReportV1, job_types
from tests.jobapp.jobs import PingV1
from tests.support.enqueue import COLUMNS
from tests.support.prepared import other_session

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
    """The alias a batch goes to is one lookup a type, but a pass over every job: the producer
    works it out once, inside the caller's transaction too, and the queue not again."""
    calls = []
    real = routing.route
    monkeypatch.setattr(routing, "route", lambda jobs, using: calls.append(1) or real(jobs, using))
    with transaction.atomic() if inside else contextlib.nullcontext():
        results = enqueue_many([PingV1(message=str(n)) for n in range(COPY_AT_LEAST * 2)])

    assert len(calls) == 1
    assert [r.id for r in results] == sorted(r.id for r in results)
    assert Job.objects.count() == COPY_AT_LEAST * 2


NAME = "hostile.a.v1"


def _batch(size: int) -> list[NewJob]:
    return [NewJob(NAME, {"n": n}) for n in range(size)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("size", [3, COPY_AT_LEAST * 2])
def test_enqueue_many_takes_a_generator(size):
    """``enqueue_many`` takes any iterable, a generator too, on the COPY path as well: it never
    reads ``len(jobs)`` before it has the jobs."""
    results = queue.enqueue_many(NewJob(NAME, {"n": n}) for n in range(size))
    assert len(results) == size
    assert Job.objects.count() == size


@pytest.mark.django_db(transaction=True)
def test_a_manual_transaction_keeps_its_writes_when_a_large_batch_is_refused():
    """With autocommit off (no atomic block) an invalid job of a large batch leaves
    the caller's earlier write and its transaction usable; the index is the bad job's."""
    transaction.set_autocommit(False)
    try:
        queue.enqueue_many(_batch(2))  # the caller's own write
        bad = _batch(COPY_AT_LEAST * 2)
        bad[100] = NewJob(NAME, {"n": 1}, max_attempts=0)
        with pytest.raises(InvalidJob, match="max_attempts") as raised:
            queue.enqueue_many(bad)
        assert raised.value.index == 100
        queue.enqueue_many(_batch(COPY_AT_LEAST))
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert Job.objects.count() == 2 + COPY_AT_LEAST


@pytest.mark.django_db(transaction=True)
def test_the_connection_works_after_a_copy_was_aborted():
    """After InvalidJob ends a COPY, the next statements and batches run."""
    bad = _batch(COPY_AT_LEAST * 2)
    bad[-1] = NewJob("", {"n": 1})
    with pytest.raises(InvalidJob) as raised:
        queue.enqueue_many(bad)
    assert raised.value.index == len(bad) - 1
    assert Job.objects.count() == 0
    assert len(queue.enqueue_many(_batch(COPY_AT_LEAST))) == COPY_AT_LEAST
    assert Job.objects.count() == COPY_AT_LEAST


NOOP = "test.noop.v1"


QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def stored_exactly(results, absolute: frozenset[int] = frozenset()) -> list[tuple]:
    """Each result's row, in order; due times as offsets from created_at (in microseconds),
    except at the ``absolute`` positions (jobs given a run_after), where the time itself."""
    rows = {job.pk: job for job in Job.objects.filter(pk__in=[r.id for r in results])}
    out = []
    for position, result in enumerate(results):
        job = rows[result.id]
        due = (
            job.run_after
            if position in absolute
            else (job.run_after - job.created_at) // timedelta(microseconds=1)
        )
        out.append(
            (
                job.name,
                job.payload,
                job.tenant,
                job.queue,
                job.priority,
                job.max_attempts,
                job.state,
                job.key_held,
                job.keyed,
                job.fair,
                job.batch_id,
                job.waiting_on,
                due,
                len(job.job_id),
            )
        )
    return out


def reported(results) -> list[tuple]:
    return [(r.tenant, r.name, r.state, r.created, r.using) for r in results]


@contextlib.contextmanager
def callers_transaction(mode: str):
    if mode == "atomic":
        with transaction.atomic():
            yield
        return
    transaction.set_autocommit(False)
    try:
        yield
        transaction.commit()
    finally:
        transaction.set_autocommit(True)


def draw_batch(data, size: int, batch_id: int | None, at) -> tuple[list[NewJob], frozenset[int]]:
    delays = st.one_of(
        st.none(),
        st.integers(-7200, 7200).map(lambda s: ("delay", timedelta(seconds=s))),
        st.integers(-(10**7), 10**7).map(lambda us: ("delay", timedelta(microseconds=us))),
        st.integers(-3600, 3600).map(lambda s: ("run_after", at + timedelta(seconds=s))),
    )
    jobs, absolute = [], set()
    for n in range(size):
        due = data.draw(delays)
        timing = {} if due is None else {due[0]: due[1]}
        if due is not None and due[0] == "run_after":
            absolute.add(n)
        jobs.append(
            NewJob(
                data.draw(st.sampled_from(NAMES)),
                {"n": n, "é": "\U0001f600"},
                tenant=data.draw(st.sampled_from([None, "acme", "globex"])),
                queue=data.draw(st.sampled_from([None, "fast"])),
                priority=data.draw(st.integers(-100, 100)),
                max_attempts=data.draw(st.sampled_from([None, 1, 7])),
                batch_id=batch_id,
                **timing,
            )
        )
    return jobs, frozenset(absolute)


@pytest.mark.django_db(transaction=True)
@settings(max_examples=20, deadline=None, suppress_health_check=QUIET)
@given(
    data=st.data(),
    size=st.integers(COPY_AT_LEAST, COPY_AT_LEAST + 30),
    kind=st.sampled_from(["list", "tuple", "generator", "one-object"]),
    mode=st.sampled_from(["atomic", "autocommit-off"]),
    using=st.sampled_from([None, "default"]),
    fair=st.sets(st.sampled_from(NAMES)),
    in_batch=st.booleans(),
)
def test_inside_a_transaction_a_large_batch_stores_and_reports_what_the_general_path_did(
    monkeypatch, data, size, kind, mode, using, fair, in_batch
):
    """Any large keyless batch in the caller's transaction, given as a list, a tuple, a
    generator or one NewJob repeated, with due times, delays (negative, microseconds),
    priorities, tenants, queues, a ``batch_id`` and tenant-ordered types: the direct COPY
    stores the rows and returns the results the INSERT statement gives; ids rise in input
    order, with no SAVEPOINT."""
    Job.objects.all().delete()
    FlowGate.objects.all().delete()
    for name in fair:
        FlowGate.objects.create(name=name, tenant_ordered=True)
    batch_id = queue.batches.open() if in_batch else None
    jobs, absolute = draw_batch(data, size, batch_id, timezone.now())
    if kind == "one-object":
        jobs, absolute = [jobs[0]] * size, frozenset(range(size)) if 0 in absolute else frozenset()

    def given_as():
        return {"list": list, "tuple": tuple, "generator": iter}.get(kind, list)(jobs)

    def run() -> tuple[list, list, list]:
        with CaptureQueriesContext(connection) as statements, callers_transaction(mode):
            results = queue.enqueue_many(given_as(), using=using)
        assert not any("SAVEPOINT" in q["sql"] for q in statements)
        ids = [r.id for r in results]
        assert ids == sorted(ids) and len(set(ids)) == size
        copied = [q["sql"].startswith("COPY") for q in statements]
        return stored_exactly(results, absolute), reported(results), copied

    direct, direct_results, direct_copy = run()
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted, inserted_results, insert_copy = run()
    monkeypatch.undo()

    assert any(direct_copy) and not any(insert_copy)
    assert direct == inserted
    assert direct_results == inserted_results
    assert {r[4] for r in direct_results} == {"default"}
    assert all(r[2:4] == ("queued", True) for r in direct_results)


@pytest.mark.django_db(transaction=True)
def test_a_copied_batch_in_the_callers_transaction_is_announced_only_at_commit():
    """Workers are woken by NOTIFY: for a batch copied in the caller's transaction the
    notices must come with its commit, never before. A sentinel NOTIFY sent by another session
    while the transaction is open arrives alone; each due name arrives once after commit."""
    jobs = [NewJob(NAMES[n % 2], {"n": n}) for n in range(COPY_AT_LEAST)]
    jobs.append(NewJob("copy.later.v1", {}, delay=timedelta(hours=1)))
    with other_session() as listener, other_session() as sender:
        listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        heard: list[str] = []

        def hear_until(predicate) -> None:
            deadline = time.monotonic() + 10
            while not predicate() and time.monotonic() < deadline:
                heard.extend(n.payload for n in listener.notifies(timeout=0.05))
            assert predicate(), heard

        with transaction.atomic():
            results = queue.enqueue_many(jobs)
            sender.execute(f"NOTIFY {NOTIFY_CHANNEL}, 'sentinel'")
            hear_until(lambda: "sentinel" in heard)
            assert heard == ["sentinel"]
        hear_until(lambda: set(NAMES) <= set(heard))
        sender.execute(f"NOTIFY {NOTIFY_CHANNEL}, 'sentinel-2'")
        hear_until(lambda: "sentinel-2" in heard)
    assert len(results) == COPY_AT_LEAST + 1
    assert sorted(heard) == sorted(["sentinel", *NAMES, "sentinel-2"])


@pytest.fixture
def two_databases(monkeypatch, settings):
    monkeypatch.setattr(catalogue, "_registry", Registry([*get_registry(), *job_types()]))
    settings.JOBS = {**settings.JOBS, "DATABASES": ["default", OTHER]}


@pytest.mark.django_db(transaction=True, databases=["default", OTHER])
def test_a_batch_for_another_database_copies_there_and_follows_that_transaction(two_databases):
    """Types bound to ``other``: inside ``atomic(using="other")`` the batch is copied into
    that transaction (rolled back with it; results say ``other``); inside a transaction on
    ``default`` only it goes in a transaction of its own on ``other``, as before; refused for
    ``default`` before anything is sent there."""
    reports = [ReportV1(number=n) for n in range(COPY_AT_LEAST)]
    with pytest.raises(RuntimeError), transaction.atomic(using=OTHER):
        with CaptureQueriesContext(connections[OTHER]) as statements:
            results = enqueue_many(reports)
        assert {r.using for r in results} == {OTHER}
        assert Job.objects.using(OTHER).count() == COPY_AT_LEAST
        raise RuntimeError("the business write failed")
    assert any(q["sql"].startswith("COPY") for q in statements)
    assert not Job.objects.using(OTHER).exists()

    with pytest.raises(RuntimeError), transaction.atomic():
        kept = enqueue_many(reports)
        raise RuntimeError("rolls back default only")
    assert sorted(Job.objects.using(OTHER).values_list("pk", flat=True)) == [r.id for r in kept]

    with transaction.atomic(), CaptureQueriesContext(connection) as sent:
        with pytest.raises(InvalidJob, match="lives in database 'other'"):
            enqueue_many(reports, using="default")
        queue.enqueue(NewJob(NAME, {}))  # the caller's transaction goes on
    assert len(sent) == 1 and not Job.objects.filter(name=ReportV1.job_name).exists()


JSON_TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**40), 10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | JSON_TEXT
    | st.sampled_from(['"', "\\", "\\u0000", "\U0001f600\U00010348", "\u2028\t\n\r\x7f"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=10,
)


PAYLOADS = st.lists(st.dictionaries(JSON_TEXT, JSON, max_size=4), min_size=1, max_size=6)


def payload_texts(results) -> list[str]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT id, payload::text FROM jobs_job WHERE id = ANY(%s)", [[r.id for r in results]]
        )
        by_id = dict(cur.fetchall())
    return [by_id[r.id] for r in results]


@pytest.mark.django_db(transaction=True)
@settings(max_examples=40, deadline=None, suppress_health_check=QUIET)
@given(payloads=PAYLOADS)
@example(payloads=[{}])
@example(payloads=[{"long": "é\U0001f600" * 20_000, "n": [1.5e300, -0.0, 10**30]}])
def test_any_payload_copied_is_stored_as_the_insert_statement_stores_it(monkeypatch, payloads):
    """Any JSON payload (every plane of unicode, quotes, backslashes, escaped NULs as text,
    control and line-separator characters, long texts, big numbers, the empty object) sent
    by COPY as jsonb's binary form named ``text`` is stored exactly as the INSERT path stores
    it, position by position, and reads back as the payload."""
    jobs = [NewJob(NOOP, payloads[n % len(payloads)]) for n in range(COPY_AT_LEAST)]
    copied = queue.enqueue_many(jobs)
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted = queue.enqueue_many(jobs)
    monkeypatch.undo()
    assert payload_texts(copied) == payload_texts(inserted)
    with connection.cursor() as cur:  # and it is the JSON dumps wrote, as the server reads it
        cur.execute("SELECT unnest(%s::text[])::jsonb::text", [[text.dumps(p) for p in payloads]])
        assert payload_texts(copied[: len(payloads)]) == [row[0] for row in cur.fetchall()]


MICROSECONDS_MAX = enqueue_module.DELAY_MAX // timedelta(microseconds=1)


@pytest.mark.django_db(transaction=True)
@settings(max_examples=30, deadline=None, suppress_health_check=QUIET)
@given(
    picks=st.lists(
        st.one_of(
            st.none(),
            st.integers(-MICROSECONDS_MAX, MICROSECONDS_MAX).map(
                lambda us: ("delay", timedelta(microseconds=us))
            ),
            st.integers(-5, 5).map(lambda s: ("delay", timedelta(seconds=s))),
            st.integers(-(10**12), 10**12).map(
                lambda us: ("run_after", timedelta(microseconds=us))
            ),
        ),
        min_size=1,
        max_size=8,
    )
)
@example(picks=[("delay", timedelta(0)), ("delay", -timedelta(microseconds=1)), None])
@example(picks=[("delay", enqueue_module.DELAY_MAX), ("delay", -enqueue_module.DELAY_MAX)])
def test_due_times_copied_match_the_insert_for_any_mix(monkeypatch, picks):
    """Due times are worked out once per delay: for any mix of delays (zero, negative, up to
    DELAY_MAX, to the microsecond), due times and none, every copied row is due exactly when
    the INSERT statement makes it due (same offset from its created_at, or the same time)."""
    at = timezone.now()
    jobs, absolute = [], set()
    for n in range(COPY_AT_LEAST):
        pick = picks[n % len(picks)]
        if pick is None:
            jobs.append(NewJob(NOOP, {}))
        elif pick[0] == "delay":
            jobs.append(NewJob(NOOP, {}, delay=pick[1]))
        else:
            absolute.add(n)
            jobs.append(NewJob(NOOP, {}, run_after=at + pick[1]))
    copied = stored_exactly(queue.enqueue_many(jobs), frozenset(absolute))
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted = stored_exactly(queue.enqueue_many(jobs), frozenset(absolute))
    monkeypatch.undo()
    assert copied == inserted


@pytest.mark.django_db(transaction=True)
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
def test_a_large_batch_with_use_tz_off_is_enqueued():
    """USE_TZ=False is supported (a batch of two is due one hour after its clock:
    test_enqueue.py). A batch of COPY_AT_LEAST keyless jobs reads the clock back naive and
    hands it to COPY's binary timestamptz, which cannot subtract a naive time from its aware
    epoch: the due times are still one hour after the clock."""
    results = queue.enqueue_many([NewJob(NOOP, {}, delay=timedelta(hours=1))] * COPY_AT_LEAST)
    with connection.cursor() as cur:
        cur.execute("SELECT DISTINCT run_after - created_at FROM jobs_job")
        assert cur.fetchall() == [(timedelta(hours=1),)]
    assert len(results) == COPY_AT_LEAST
