"""The queue's bound cursors: one kept per connection between statements, never shared by two
uses at once, never kept with a large result, and never reused on a connection other than its
own."""

from __future__ import annotations

import contextlib
import importlib
import json
import threading
from datetime import timedelta

import pytest
from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    connection,
    connections,
    transaction,
)
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from jobs import queue
from jobs.models import Job
from jobs.queue import (
    ClaimRequest,
    NewJob,
    Outcome,
    _db,
)
from tests.support.noop_jobs import NAME, SCOPE, claim, enqueue
from tests.support.prepared import other_session, prepare_threshold, queue_prepares

pytestmark = pytest.mark.django_db(transaction=True)


def made(monkeypatch) -> list[object]:
    """The bound cursors made from now on."""
    cursors: list[object] = []
    original = _db._BoundCursor.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        cursors.append(self)

    monkeypatch.setattr(_db._BoundCursor, "__init__", init)
    return cursors


def select_json(value: object) -> object:
    with _db.bound_cursor(None) as cur:
        cur.execute("SELECT %(v)s::jsonb", {"v": Jsonb(value)})
        return json.loads(cur.fetchone()[0])  # Django's loader leaves JSON as text


def test_statements_one_after_another_use_one_cursor(monkeypatch):
    select_json(0)  # the connection's cursor exists
    cursors = made(monkeypatch)
    for n in range(20):
        assert select_json({"n": n}) == {"n": n}
    assert len(cursors) == 0


def test_a_use_inside_another_gets_a_cursor_of_its_own(monkeypatch):
    select_json(0)
    cursors = made(monkeypatch)
    with _db.bound_cursor(None) as outer:
        outer.execute("SELECT generate_series(1, 3)")
        assert select_json([1]) == [1]  # a second cursor while the first still has rows
        assert [row[0] for row in outer.fetchall()] == [1, 2, 3]
    assert len(cursors) == 1
    # One is kept afterwards, not both, and used again.
    assert select_json(2) == 2
    assert len(cursors) == 1


def test_a_copy_cursor_is_kept_with_the_connections_adapters(monkeypatch):
    """COPY sends a jsonb column's binary form as text (``JSONB_AS_TEXT``), so it changes
    no adapter of the cursor: kept, the cursor still sends a Python string given as Json as
    JSON. (A COPY that set the cursor's JSON dumper to pass text through could not keep it.)
    """
    select_json(0)
    cursors = made(monkeypatch)
    with _db.bound_cursor(None) as cur:
        cur.execute("CREATE TEMPORARY TABLE copied (doc jsonb)")
        _db.copy_rows(
            cur,
            "COPY copied (doc) FROM STDIN (FORMAT BINARY)",
            [_db.JSONB_AS_TEXT],
            [[_db.JSONB_VERSION + '{"a": 1, "b": "é"}']],
        )
    assert select_json("text") == "text"
    assert len(cursors) == 0
    with connection.cursor() as cur:
        cur.execute("SELECT doc FROM copied")
        assert cur.fetchone()[0] == '{"a": 1, "b": "é"}'


def test_a_large_result_is_not_kept(monkeypatch):
    with _db.bound_cursor(None) as cur:
        cur.execute("SELECT generate_series(1, %(n)s)", {"n": _db.KEEP_ROWS + 1})
        big = cur.cursor
    assert big.closed


def test_a_cursor_of_a_closed_connection_is_not_used(monkeypatch):
    select_json(0)
    connection.close()
    cursors = made(monkeypatch)
    assert select_json(1) == 1
    assert len(cursors) == 1


def test_a_statement_that_failed_leaves_no_cursor_behind(monkeypatch):
    select_json(0)
    with pytest.raises(Exception), _db.bound_cursor(None) as cur:  # noqa: B017
        kept = cur.cursor
        cur.execute("SELECT 1/0")
    assert kept.closed
    assert select_json(3) == 3


OPS = st.lists(
    st.sampled_from(["json", "nested", "error", "large", "close"]), min_size=1, max_size=12
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, value=st.integers(-(2**63), 2**63 - 1))
def test_any_sequence_of_uses_answers_as_fresh_cursors_would(ops, value):
    for op in ops:
        if op == "json":
            assert select_json({"v": value}) == {"v": value}
        elif op == "nested":
            with _db.bound_cursor(None) as outer:
                outer.execute("SELECT %(v)s::bigint", {"v": value})
                assert select_json([value]) == [value]
                assert outer.fetchone()[0] == value
        elif op == "error":
            with pytest.raises(Exception), _db.bound_cursor(None) as cur:  # noqa: B017
                cur.execute("SELECT 1/0")
        elif op == "large":
            with _db.bound_cursor(None) as cur:
                cur.execute("SELECT generate_series(1, %(n)s)", {"n": _db.KEEP_ROWS + 5})
                assert len(cur.fetchall()) == _db.KEEP_ROWS + 5
        else:
            connection.close()
    assert select_json(value) == value


@pytest.mark.parametrize("threshold, prepared", [(None, False), (0, False), (None, True)])
def test_statements_are_prepared_as_the_jobs_setting_says(threshold, prepared):
    """Off by default: nothing is prepared, which a pooler in transaction mode needs unless it
    keeps prepared statements itself (PgBouncer 1.21+ with ``max_prepared_statements``), even
    where the project's ``OPTIONS`` prepare its own. ``JOBS["PREPARED_STATEMENTS"]`` on: the
    server parses and plans a single enqueue once a connection, not once a job."""
    from jobs import queue

    with prepare_threshold(threshold), queue_prepares(prepared):
        for n in range(3):
            queue.enqueue(queue.NewJob("prepared.v1", {"n": n}))
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
                ["%jobs_enqueue_job(%"],
            )
            found = cur.fetchone()[0]
    assert found == (1 if prepared else 0)


@pytest.mark.parametrize("inside", [False, True])
def test_a_statement_prepared_before_a_schema_change_fails_once_then_works(inside):
    """With statements prepared, a migration from another session that changes a column a
    statement returns makes PostgreSQL refuse the prepared statement ("cached plan must not
    change result type"), and would on every later call on that connection. It fails once:
    in autocommit the connection is closed (its next use connects afresh); in a transaction
    the rollback discards what psycopg prepared."""
    from jobs import queue

    request = [queue.ClaimRequest("prepared.v1", 1)]
    claims: list[int] = []
    failures = []

    def claim() -> None:
        queue.claim(request, scope=queue.AllTenants(), worker="w")
        claims.append(1)

    with queue_prepares(True):
        try:
            queue.enqueue_many([queue.NewJob("prepared.v1", {"n": n}) for n in range(5)])
            claim()
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE integer")
            for _ in range(3):
                try:
                    with transaction.atomic() if inside else contextlib.nullcontext():
                        claim()
                except Exception as exc:
                    failures.append(str(exc))
        finally:
            connection.close()
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE smallint")
    assert len(failures) == 1 and "cached plan" in failures[0], failures
    assert len(claims) == 3


@pytest.mark.django_db
def test_a_refused_statement_on_the_binding_cursor_is_djangos_integrity_error():
    """Errors of the binding cursor come out as django.db errors, and they break the caller's
    atomic block as Django's own would (the next query raises until rollback)."""
    enqueue(1)
    [job] = claim(1)
    refused = Outcome(id=job.id, token=job.claim_token, state="bogus")  # type: ignore[arg-type]

    with transaction.atomic():
        with pytest.raises(IntegrityError), transaction.atomic():
            queue.record([refused])
        assert Job.objects.get(pk=job.id).state == "running"  # the savepoint rolled back

    with pytest.raises(IntegrityError):
        queue.record_and_claim([refused], [ClaimRequest(NAME, 1)], scope=SCOPE)


@pytest.mark.django_db
def test_the_binding_cursor_goes_through_execute_wrappers_and_query_logging():
    enqueue(3)
    seen: list[str] = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with (
        connection.execute_wrapper(wrapper),
        override_settings(DEBUG=True),
        CaptureQueriesContext(connection) as logged,
    ):
        [job] = claim(1)
        queue.record_and_claim([Outcome.succeeded(job)], [ClaimRequest(NAME, 1)], scope=SCOPE)
        queue.enqueue(NewJob(name=NAME, payload={}))

    assert len(seen) == 3 and len(logged) == 3
    assert "UPDATE jobs_job" in logged[0]["sql"] and "written" in logged[1]["sql"]


@pytest.mark.django_db(transaction=True)
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


@pytest.mark.django_db(transaction=True)
def test_a_kept_cursor_does_not_hold_on_to_its_last_result():
    with _db.bound_cursor(None) as cur:
        cur.execute("SELECT repeat('x', %(n)s::integer)", {"n": 5_000_000})  # one 5 MB row
        raw = cur.cursor
    # Closed at the end of its use, the cursor freed its result; kept, it holds it (and the
    # last statement's parameters) until the connection's next use, however big it was.
    assert raw.closed or raw.pgresult is None


@pytest.mark.django_db(transaction=True)
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


enqueue_module = importlib.import_module("jobs.queue.enqueue")


COPY_AT_LEAST = enqueue_module.COPY_AT_LEAST


@pytest.mark.django_db(transaction=True)
def test_the_cursor_kept_after_a_copy_is_the_one_used_next_and_binds_as_any_other():
    """The COPY does not change the cursor's adapters, so it is kept: the next use takes
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
        [job] = claim(1)
        assert job.payload == {"n": 0}
    finally:
        db.settings_dict["TIME_ZONE"] = saved
        for name in ("timezone", "timezone_name"):
            db.__dict__.pop(name, None)
        db.close()
