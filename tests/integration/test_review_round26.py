"""Review round 26: the commits after cc63f6c.

* 3c87547 ``text.dumps`` encodes by a C encoding function made once, with no cycle check
  (``markers=None``), and re-encodes with ``JSONEncoder.encode`` on any exception;
* ec2186d a large keyless batch inside the caller's transaction goes straight to COPY;
* 1ca96ac COPY sends a payload as jsonb's binary form named ``text``, keeps its cursor, and
  works a due time out once a delay;
* 6abe043 the bound cursor prepares as the connection's ``prepare_threshold`` says.

Pinned here (passing): ``dumps`` writes what the strict encoder writes, or refuses with its
message, for values with odd ``__repr__``/``__iter__``/``items`` overrides, non-str keys, NaN,
NUL, lone surrogates and nesting around the recursion limit, from many threads at once; inside
the caller's transaction (``atomic()`` or autocommit off) a large keyless batch stores the rows
and returns the results the general path did (lists, tuples, generators, one NewJob repeated,
``batch_id``, ``using``, due times, priorities, tenants, tenant-ordered types), is announced
only at commit, and follows the other alias's transaction; any payload is stored by COPY as
the INSERT stores it, and any mix of delays and due times too; the cursor kept after a COPY is
the next one used and binds as before; with Django's default nothing the queue does is
prepared; with ``prepare_threshold = 0`` any sequence of queue calls works (reconnects, errors
and rollbacks in transactions, statements whose text varies past psycopg's cache, a new index).

Defects found (each test failed on the reviewed code; all are fixed now, in 8864c26, 1a133fa,
77834f5 and the commit that adds this file):

* ``test_the_workers_own_connection_never_prepares_whatever_options_say``: the worker's loop
  connection is the Django connection ``dbbounds.bound()`` copies the alias's ``OPTIONS`` to,
  ``prepare_threshold`` included; the bound cursor no longer passes ``prepare=False``, so with
  ``OPTIONS["prepare_threshold"] = 0`` the worker prepares its pass and claims (it did not at
  cc63f6c). docs/operating-at-scale.md and docs/queue.md say it never does.
  (tests/integration/test_review_round14.py's prepared-statement guard fails as well.)
* ``test_a_prepared_claim_recovers_after_a_migration_changes_a_returned_column``: a queue
  statement prepared before another session changed the type of a column it returns fails
  with "cached plan must not change result type" on every later call on that connection.
* ``test_a_cyclic_value_in_a_thread_with_a_1_mib_stack_is_refused_not_a_crash``: without the
  cycle check a cycle recurses ~10,000 C frames before the fallback: in a thread with a 1 MiB
  stack (python:alpine's default) the process dies with SIGSEGV instead of refusing.
* ``test_a_payload_emptied_by_its_own_read_is_refused_not_stored_empty`` and
  ``test_a_mapping_that_refers_to_itself_once_is_still_a_cycle``: the fallback encodes a
  second time, so a value whose reading changes it is judged on its second reading: a refused
  payload is stored as ``{}``, a cycle is written out.
* ``test_a_refused_values_own_code_runs_once_and_its_error_stands_alone``: on a failure the
  value's own code (``items()``) runs twice, and its exception is chained to its first copy.
* ``test_a_large_batch_with_use_tz_off_is_enqueued`` (predates this round: fails at cc63f6c
  too): with ``USE_TZ = False`` COPY sends the naive clock as ``timestamptz`` and every batch
  of ``COPY_AT_LEAST`` keyless jobs raises TypeError.

And one more, predating this round, which the Hypothesis test of odd values drew after the
fixes: a NUL nested deeper than Python's recursion limit made the search for its path raise
RecursionError instead of ValueError (fixed in 8d8fcf4, tested in tests/unit/test_storable.py).

Every database test runs on real PostgreSQL; waits poll with deadlines.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.db import DataError, connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from jobs import enqueue, queue
from jobs.conf import NOTIFY_CHANNEL
from jobs.models import FlowGate, Job
from jobs.queue import AllTenants, ClaimRequest, InvalidJob, NewJob, Outcome, _db, text
from jobs.registry import Registry, catalogue, get_registry
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.dbapp.types import OTHER, ReportV1, job_types
from tests.support.prepared import other_session, prepare_threshold
from tests.support.storable import encoded_as_before
from tests.support.worker import Echo, Recorder, registry

enqueue_module = importlib.import_module("jobs.queue.enqueue")
COPY_AT_LEAST = enqueue_module.COPY_AT_LEAST
NAME = "test.noop.v1"
NAMES = ("r26.a.v1", "r26.b.v1")
SCOPE = AllTenants()
QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


# -- helpers ----------------------------------------------------------------------------------


def outcome(encode, value: object) -> tuple[str, str]:
    try:
        return ("ok", encode(value))
    except ValueError as exc:
        return ("refused", str(exc))


def prepared() -> list[str]:
    """The statements prepared on this thread's default connection, read by a Django cursor
    (client-side binding: it never prepares anything itself)."""
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cur.fetchall()]


def claim(limit: int = 1) -> list:
    return queue.claim([ClaimRequest(NAME, limit)], scope=SCOPE, worker="r26")


def stored(results, absolute: frozenset[int] = frozenset()) -> list[tuple]:
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


def old_enqueue_by_copy(real):
    """``_enqueue_by_copy`` as at cc63f6c: None inside the caller's transaction."""

    def enqueue_by_copy(jobs, using):
        alias = using or "default"
        db = connections[alias]
        if db.in_atomic_block or not db.get_autocommit():
            return None
        return real(jobs, using)

    return enqueue_by_copy


# -- 1. text.dumps ----------------------------------------------------------------------------


class OddStr(str):
    def __str__(self) -> str:
        return "odd"

    def __repr__(self) -> str:
        return "odd"


class OddInt(int):
    def __repr__(self) -> str:
        return "not JSON"

    __str__ = __repr__


class OddFloat(float):
    def __repr__(self) -> str:
        return "not JSON"


class OddList(list):
    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class OddTuple(tuple):
    def __iter__(self):
        return iter((1, 2, 3))


class OddItems(dict):
    """A dict whose items() says something else, the same on every call."""

    def items(self):
        return [(f"k{n}", value) for n, value in enumerate(reversed(list(self.values())))]


def self_loop(box: type) -> object:
    value = box()
    if isinstance(value, dict):
        value["me"] = value
    else:
        value.append(value)
    return value


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=4)
    | st.sampled_from(["a\x00b", "\ud800", "\\u0000", "é\U0001f600", object(), b"x", {1}, 1j])
    | st.builds(OddStr, st.text(max_size=3))
    | st.builds(OddInt, st.integers())
    | st.builds(OddFloat, st.floats())
)
KEYS = st.text(max_size=3) | st.integers() | st.floats() | st.booleans() | st.none()
ODD_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.builds(OddList, st.lists(inner, max_size=3))
        | st.builds(OddTuple, st.lists(inner, max_size=3))
        | st.dictionaries(KEYS | st.builds(OddInt, st.integers()) | st.just((1,)), inner)
        | st.builds(OddItems, st.dictionaries(st.text(max_size=2), inner, max_size=3))
        | st.builds(lambda item, box: [item, self_loop(box)], inner, st.sampled_from([list, dict]))
    ),
    max_leaves=8,
)


def nested(depth: int, box: type = list, inner: object = 0) -> object:
    value: object = inner
    for _ in range(depth):
        value = [value] if box is list else {"d": value}
    return value


@settings(max_examples=300, deadline=None)
@given(
    ODD_VALUES,
    st.sampled_from([0, 0, 0, 9_000, 9_990, 10_050, 50_000]),
    st.sampled_from([list, dict]),
)
@example(OddItems(a=self_loop(OddItems)), 0, list)
def test_dumps_writes_or_refuses_odd_values_as_the_strict_encoder_did(value, depth, box):
    """Any value (subclasses of str, int, float, list, tuple and dict whose ``__repr__``,
    ``__iter__`` or ``items`` say something else, keys of every kind, NaN, NUL, lone
    surrogates, cycles), at the top or nested on either side of the recursion limit:
    ``dumps`` writes what ``JSONEncoder.encode`` wrote at cc63f6c, or refuses it with the
    same message."""
    value = nested(depth, box, value)
    assert outcome(text.dumps, value) == outcome(encoded_as_before, value)


def test_dumps_from_many_threads_at_once_gives_each_value_its_own_answer():
    """The one encoding function is shared: 8 threads encoding at once, good values between
    refused ones (cycles, NaN, too deep, unserializable), each get the answer the strict
    encoder gives alone; a failure leaves nothing behind for the next call."""
    values = [{"n": n, "text": "é" * n, "list": list(range(n))} for n in range(5)] + [
        self_loop(list),
        {"x": float("nan")},
        nested(20_000),
        {"o": object()},
        OddItems(a=1, b=[2]),
        {1: "int key", None: "none key"},
    ]
    expected = [outcome(encoded_as_before, value) for value in values]
    start = threading.Barrier(8)
    wrong: list[tuple] = []

    def work(offset: int) -> None:
        start.wait()
        for step in range(300):
            index = (offset + step) % len(values)
            got = outcome(text.dumps, values[index])
            if got != expected[index]:
                wrong.append((index, got))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert [outcome(text.dumps, value) for value in values] == expected


CYCLE_IN_A_THREAD = """
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("text_under_test", sys.argv[1])
text = importlib.util.module_from_spec(spec)
spec.loader.exec_module(text)
if sys.argv[2] == "as-before":
    text._ENCODE = None  # JSONEncoder.encode on every call, as at cc63f6c
threading.stack_size(1 << 20)  # python:alpine builds CPython with 1 MiB thread stacks
said = []
def run():
    loop = []
    loop.append({"again": loop})
    try:
        text.dumps({"payload": loop})
    except ValueError as exc:
        said.append(str(exc))
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(said)
"""


def refuse_a_cycle_in_a_thread(how: str) -> subprocess.CompletedProcess:
    source = Path(text.__file__)
    return subprocess.run(
        [sys.executable, "-c", CYCLE_IN_A_THREAD, str(source), how],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_cyclic_value_in_a_thread_with_a_1_mib_stack_is_refused_not_a_crash():
    """A handler thread (or a web server's) with a 1 MiB stack, as python:alpine's CPython
    makes them, hands ``dumps`` a result that refers to itself. The strict encoder sees the
    cycle at the second level and refuses it (the control run); the encoding function made
    without ``markers`` recurses to the C recursion limit first, ~10,000 frames, and the
    process dies of a segmentation fault before the fallback can run."""
    control = refuse_a_cycle_in_a_thread("as-before")
    assert control.returncode == 0, control.stderr
    assert "Circular reference detected" in control.stdout

    reviewed = refuse_a_cycle_in_a_thread("as-reviewed")
    assert reviewed.returncode == 0, f"exit status {reviewed.returncode}: {reviewed.stderr}"
    assert "Circular reference detected" in reviewed.stdout


class Drained(dict):
    """A mapping read by draining it (a work list, a one-shot view): its items() empties it."""

    def items(self):
        while self:
            yield self.popitem()


@pytest.mark.django_db(transaction=True)
def test_a_payload_emptied_by_its_own_read_is_refused_not_stored_empty():
    """A payload whose reading changes it is judged on its first reading, as at cc63f6c: this
    one holds a NaN, so enqueue refuses it. The reviewed ``dumps`` fails on the first reading,
    encodes the now empty mapping again, and the job is stored with the payload ``{}``."""
    with pytest.raises(InvalidJob, match="not JSON-serializable"):
        queue.enqueue(NewJob(NAME, Drained(order=7, score=float("nan"))))
    assert list(Job.objects.values_list("payload", flat=True)) == []


class SelfOnce(dict):
    """A mapping whose first reading holds itself, later readings a plain value."""

    def __init__(self) -> None:
        super().__init__(x=1)
        self.reads = 0

    def items(self):
        self.reads += 1
        return [("self", self)] if self.reads == 1 else [("x", 1)]


def test_a_mapping_that_refers_to_itself_once_is_still_a_cycle():
    """The strict encoder refuses a container that holds itself the moment it meets it again
    ("Circular reference detected"). Without that check the encoding function reads the
    mapping a second time, finds a plain value, and ``dumps`` returns ``{"self":{"x":1}}``."""
    assert outcome(encoded_as_before, SelfOnce()) == ("refused", "Circular reference detected")
    assert outcome(text.dumps, SelfOnce()) == ("refused", "Circular reference detected")


class Failing(dict):
    reads = 0

    def items(self):
        Failing.reads += 1
        raise LookupError("the backing store is gone")


def test_a_refused_values_own_code_runs_once_and_its_error_stands_alone():
    """A payload's ``items()`` that raises: at cc63f6c it ran once and its error came out as
    raised. The reviewed ``dumps`` runs it, swallows the error, runs it again from the
    fallback, and raises the second error with the first as its ``__context__``."""
    Failing.reads = 0
    with pytest.raises(LookupError) as raised:
        text.dumps(Failing(a=1))
    assert Failing.reads == 1
    assert raised.value.__context__ is None


# -- 2. a large keyless batch inside the caller's transaction ---------------------------------


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
    stores the rows and returns the results the general path returned at cc63f6c, and those
    the INSERT statement gives; ids rise in input order, with no SAVEPOINT."""
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
        return stored(results, absolute), reported(results), copied

    direct, direct_results, direct_copy = run()
    monkeypatch.setattr(
        enqueue_module, "_enqueue_by_copy", old_enqueue_by_copy(enqueue_module._enqueue_by_copy)
    )
    general, general_results, _ = run()
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted, inserted_results, insert_copy = run()
    monkeypatch.undo()

    assert any(direct_copy) and not any(insert_copy)
    assert direct == general == inserted
    assert direct_results == general_results == inserted_results
    assert {r[4] for r in direct_results} == {"default"}
    assert all(r[2:4] == ("queued", True) for r in direct_results)


@pytest.mark.django_db(transaction=True)
def test_a_copied_batch_in_the_callers_transaction_is_announced_only_at_commit():
    """Workers are woken by NOTIFY: for a batch copied in the caller's transaction the
    notices must come with its commit, never before. A sentinel NOTIFY sent by another session
    while the transaction is open arrives alone; each due name arrives once after commit."""
    jobs = [NewJob(NAMES[n % 2], {"n": n}) for n in range(COPY_AT_LEAST)]
    jobs.append(NewJob("r26.later.v1", {}, delay=timedelta(hours=1)))
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
    reports = [NewJob(ReportV1.job_name, {"number": n}) for n in range(COPY_AT_LEAST)]
    with pytest.raises(RuntimeError), transaction.atomic(using=OTHER):
        with CaptureQueriesContext(connections[OTHER]) as statements:
            results = queue.enqueue_many(reports)
        assert {r.using for r in results} == {OTHER}
        assert Job.objects.using(OTHER).count() == COPY_AT_LEAST
        raise RuntimeError("the business write failed")
    assert any(q["sql"].startswith("COPY") for q in statements)
    assert not Job.objects.using(OTHER).exists()

    with pytest.raises(RuntimeError), transaction.atomic():
        kept = queue.enqueue_many(reports)
        raise RuntimeError("rolls back default only")
    assert sorted(Job.objects.using(OTHER).values_list("pk", flat=True)) == [r.id for r in kept]

    with transaction.atomic(), CaptureQueriesContext(connection) as sent:
        with pytest.raises(InvalidJob, match="lives in database 'other'"):
            queue.enqueue_many(reports, using="default")
        queue.enqueue(NewJob(NAME, {}))  # the caller's transaction goes on
    assert len(sent) == 1 and not Job.objects.filter(name=ReportV1.job_name).exists()


# -- 3. COPY: payloads and due times ----------------------------------------------------------

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
    jobs = [NewJob(NAME, payloads[n % len(payloads)]) for n in range(COPY_AT_LEAST)]
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
            jobs.append(NewJob(NAME, {}))
        elif pick[0] == "delay":
            jobs.append(NewJob(NAME, {}, delay=pick[1]))
        else:
            absolute.add(n)
            jobs.append(NewJob(NAME, {}, run_after=at + pick[1]))
    copied = stored(queue.enqueue_many(jobs), frozenset(absolute))
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
    inserted = stored(queue.enqueue_many(jobs), frozenset(absolute))
    monkeypatch.undo()
    assert copied == inserted


@pytest.mark.django_db(transaction=True)
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
def test_a_large_batch_with_use_tz_off_is_enqueued():
    """USE_TZ=False is supported (review round 14: a batch of two is due one hour after its
    clock). A batch of COPY_AT_LEAST keyless jobs reads the clock back naive and hands it to
    COPY's binary timestamptz, which cannot subtract a naive time from its aware epoch."""
    results = queue.enqueue_many([NewJob(NAME, {}, delay=timedelta(hours=1))] * COPY_AT_LEAST)
    with connection.cursor() as cur:
        cur.execute("SELECT DISTINCT run_after - created_at FROM jobs_job")
        assert cur.fetchall() == [(timedelta(hours=1),)]
    assert len(results) == COPY_AT_LEAST


@pytest.mark.django_db(transaction=True)
def test_the_cursor_kept_after_a_copy_is_the_one_used_next_and_binds_as_before():
    """The COPY no longer changes the cursor's adapters, so it is kept: the next use takes
    that very cursor, which sends JSON given as Json as JSON, binary arrays and times, and
    reads times in the connection's time zone (a database ``TIME_ZONE`` of +05:45)."""
    db = connections["default"]
    saved = db.settings_dict["TIME_ZONE"]
    db.settings_dict["TIME_ZONE"] = "Asia/Kathmandu"
    for name in ("timezone", "timezone_name"):
        db.__dict__.pop(name, None)
    db.close()
    try:
        queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(COPY_AT_LEAST)])
        kept = _db._idle.get(db)
        assert kept is not None and not kept.closed
        when = timezone.now()
        with _db.bound_cursor(None) as cur:
            assert cur.cursor is kept
            cur.execute(
                "SELECT %(doc)s::jsonb, %(ids)b::bigint[], %(at)s::timestamptz",
                {"doc": Jsonb({"é": ["\U0001f600", 1]}), "ids": [1, 2], "at": when},
            )
            doc, ids, at = cur.fetchone()
        assert json.loads(doc) == {"é": ["\U0001f600", 1]} and ids == [1, 2]
        assert at == when and at.utcoffset() == timedelta(hours=5, minutes=45)
        [job] = claim()
        assert job.payload == {"n": 0}
    finally:
        db.settings_dict["TIME_ZONE"] = saved
        for name in ("timezone", "timezone_name"):
            db.__dict__.pop(name, None)
        db.close()


# -- 4. prepared statements -------------------------------------------------------------------


def every_kind_of_call() -> None:
    """Enqueue (single, keyed, taken key, batch, keyed batch, with after, COPY outside and
    inside a transaction), claims, outcomes, the worker's pass, renewals, admin actions."""
    first = queue.enqueue(NewJob(NAME, {"n": 1}))
    keyed = queue.enqueue(NewJob(NAME, {}, job_id=f"k-{first.id}"))
    again = queue.enqueue(NewJob(NAME, {}, job_id=f"k-{first.id}"))
    assert (again.id, again.created) == (keyed.id, False)
    queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(3)])
    queue.enqueue_many([NewJob(NAME, {}, job_id=f"b-{first.id}-{n}") for n in range(3)])
    queue.enqueue(NewJob(NAME, {}, after=(first.id,)))
    queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(COPY_AT_LEAST)])
    with transaction.atomic():
        queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(COPY_AT_LEAST)])
    [job] = claim()
    queue.record([Outcome.succeeded(job, {"ok": True})])
    [job] = claim()
    queue.renew([job])
    queue.record_and_claim([Outcome.succeeded(job)], [ClaimRequest(NAME, 1)], scope=SCOPE)
    victim = queue.enqueue(NewJob(NAME, {}))
    assert queue.cancel([victim.id], by="r26") == [victim.id]
    assert queue.run_now([first.id]) in ([first.id], [])


@pytest.mark.django_db(transaction=True)
def test_with_djangos_default_nothing_the_queue_does_is_prepared():
    """Behind a transaction-mode PgBouncer a prepared statement is missing on the next server
    connection: with Django's default ``prepare_threshold`` (None) no call of the queue on
    the user's connection prepares anything, COPY and its kept cursor included."""
    with prepare_threshold(None):
        every_kind_of_call()
        every_kind_of_call()
        assert prepared() == []


OPS = st.lists(
    st.sampled_from(
        ["calls", "close", "error-in-atomic", "rollback", "refused-after", "varied-sql"]
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.django_db(transaction=True)
@settings(max_examples=15, deadline=None, suppress_health_check=QUIET)
@given(ops=OPS)
@example(ops=["calls", "error-in-atomic", "close", "rollback", "refused-after", "varied-sql"])
def test_with_threshold_0_any_sequence_of_queue_calls_works(ops):
    """``OPTIONS["prepare_threshold"] = 0`` prepares every statement from its first use. Any
    sequence of: every kind of queue call, a reconnect, a failed statement inside a
    transaction (savepoint rolled back), a rolled-back transaction that copied a batch, a
    dependency refused in a savepoint, more than psycopg's 100 cached statements of varying
    text; each call answers right, and the queue's statements are prepared indeed."""
    with prepare_threshold(0):
        for op in ops:
            if op == "calls":
                every_kind_of_call()
            elif op == "close":
                connection.close()
            elif op == "error-in-atomic":
                with transaction.atomic():
                    queue.enqueue(NewJob(NAME, {}))
                    with pytest.raises(DataError), transaction.atomic():
                        queue.enqueue_many([NewJob(NAME, {}, job_id="e") for _ in range(2)])
                        with _db.bound_cursor(None) as cur:
                            cur.execute("SELECT 1 / %(zero)s", {"zero": 0})
                    assert queue.enqueue(NewJob(NAME, {})).created
            elif op == "rollback":
                before = Job.objects.count()
                with pytest.raises(RuntimeError), transaction.atomic():
                    queue.enqueue_many([NewJob(NAME, {}) for _ in range(COPY_AT_LEAST)])
                    raise RuntimeError("rolled back")
                assert Job.objects.count() == before
            elif op == "refused-after":
                with transaction.atomic():
                    with pytest.raises(InvalidJob):
                        queue.enqueue(NewJob(NAME, {}, after=(10**15,)))
                    assert queue.enqueue(NewJob(NAME, {})).created
            else:
                for n in range(110):
                    with _db.bound_cursor(None) as cur:
                        cur.execute(f"SELECT %(v)s::int + {n}", {"v": 1})
                        assert cur.fetchone() == (n + 1,)
        queue.enqueue(NewJob(NAME, {}))
        assert any("jobs_enqueue_job(" in s for s in prepared())


@pytest.mark.django_db(transaction=True)
def test_with_threshold_0_a_plan_change_from_a_new_index_is_taken_in_stride():
    """Another session adds an index and drops it again while the claim is prepared here:
    the server plans the statement again each time, and every claim answers."""
    with prepare_threshold(0):
        queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(6)])
        assert len(claim()) == 1
        with other_session() as other:
            other.execute("CREATE INDEX r26_by_priority ON jobs_job (name, priority, id)")
            assert len(claim()) == 1
            other.execute("DROP INDEX r26_by_priority")
        assert len(claim()) == 1
        assert any("claimed" in s or "jobs_job" in s for s in prepared())


@pytest.mark.django_db(transaction=True)
def test_the_workers_own_connection_never_prepares_whatever_options_say():
    """docs/queue.md: "The worker's and scheduler's connections of their own never prepare."
    A project sets ``OPTIONS["prepare_threshold"] = 0`` for its web processes; a real Worker
    runs jobs, and its loop connection, read between two passes, holds prepared statements
    (its pass, its claims). At cc63f6c it held none."""
    with prepare_threshold(0):
        jobs = [enqueue(Echo(text=str(n))) for n in range(5)]
        seen: list[str] = []

        def until(_worker: Worker) -> bool:
            done = Job.objects.filter(pk__in=[j.id for j in jobs], state="succeeded").count()
            if done < len(jobs):
                return False
            seen.extend(prepared())  # the loop's own connection, bounded, in this thread
            return True

        config = WorkerConfig(install_signal_handlers=False, poll_interval=0.05)
        Worker(registry(Recorder()), config).run(until=until)  # its loop runs on this thread
    assert seen == []


@pytest.mark.django_db(transaction=True)
def test_a_prepared_claim_recovers_after_a_migration_changes_a_returned_column():
    """With ``prepare_threshold = 0`` the claim is prepared on the user's connection; a
    deploy's migration (another session) widens ``jobs_job.priority``, a column the claim
    returns. The first claim after it may fail, but the connection never recovers: psycopg
    keeps running the stale statement, and every later claim fails the same way (the ORM,
    unprepared, goes on). At cc63f6c nothing was prepared and every claim answered."""
    failures = []
    with prepare_threshold(0):
        queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(4)])
        assert len(claim()) == 1
        try:
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE integer")
            for _ in range(3):
                try:
                    claim()
                except psycopg.Error as exc:
                    failures.append(str(exc))
                except Exception as exc:
                    failures.append(str(exc))
        finally:
            connection.close()
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE smallint")
    assert len(failures) <= 1, failures
