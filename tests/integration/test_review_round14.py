"""Review round 14: the claim scan (7eb023e), enqueue in autocommit (910bae5), the binding
cursor (6505d90) and the worker's one-statement pass (record_and_claim).

Tests named ``test_bug_...`` failed on the reviewed code and pass since their fixes: a stale
attempt's outcome in the same batch as the fresh one's is fenced by its token (a bug since the
batched outcomes), a batch mixing naive and aware retry times is written, and max_attempts
past the integer column is an InvalidJob; ``test_guard_...`` pin behaviour a fix must keep.
Every test
runs on real PostgreSQL; concurrent ones use real threads and poll with deadlines.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from jobs import dbbounds, queue
from jobs.models import Job, TenantOverride
from jobs.queue import (
    AllTenants,
    AllTenantsExcept,
    ClaimRequest,
    InvalidJob,
    NewJob,
    Outcome,
    claim_sql,
)
from tests.support.prepared import prepare_threshold

NAME = "test.noop.v1"
SCOPE = AllTenants()


# -- helpers --------------------------------------------------------------------------------


def enqueue(count: int, **options: Any) -> list[int]:
    jobs = [NewJob(name=NAME, payload={}, **options)] * count
    return [e.id for e in queue.enqueue_many(jobs)]


def claim(limit: int, scope=SCOPE) -> list:
    return queue.claim([ClaimRequest(NAME, limit)], scope=scope, worker="w")


def prepared_statements() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_statements")
        return cur.fetchone()[0]


# -- bugs -----------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("stale_first", [True, False], ids=["stale-first", "fresh-first"])
@pytest.mark.parametrize("write", ["record", "record_and_claim"])
def test_bug_a_stale_outcome_in_the_batch_is_fenced_by_its_token(stale_first, write):
    """A worker can hold a stale attempt and a fresh claim of one job at once (runner._held is
    keyed by (id, token)); both outcomes may land in one pass. Only the one whose token holds
    the row may be written; the stale one is fenced."""
    enqueue(1)
    [fresh] = claim(1)
    stale = dataclasses.replace(fresh, claim_token=uuid.uuid4())
    outcomes = [Outcome.failed(stale, code="stale_attempt"), Outcome.succeeded(fresh, {"ok": 1})]
    if not stale_first:
        outcomes.reverse()

    if write == "record":
        report = queue.record(outcomes)
    else:
        report, _ = queue.record_and_claim(outcomes, [], scope=SCOPE)

    job = Job.objects.get(pk=fresh.id)
    assert (job.state, job.last_error, job.result) == ("succeeded", "", {"ok": 1})
    # One outcome applied, one fenced (reported by id, so the id appears once in each).
    assert (report.applied, report.fenced) == ((fresh.id,), (fresh.id,))


@pytest.mark.django_db
def test_bug_a_batch_mixing_naive_and_aware_retry_times_is_written():
    """Outcome's constructors promise one outcome cannot make a batch fail to write; the text
    quoting before 6505d90 adapted every element by itself and wrote this batch."""
    enqueue(2)
    first, second = claim(2)
    at = datetime(2030, 1, 1, 12, 0)
    outcomes = [
        Outcome.retry(first, code="later", at=at.replace(tzinfo=UTC)),
        Outcome.retry(second, code="later", at=at),  # naive: the session's zone (UTC)
    ]

    report = queue.record(outcomes)

    assert report.applied == (first.id, second.id)
    assert set(Job.objects.values_list("run_after", flat=True)) == {at.replace(tzinfo=UTC)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("count", [1, 2], ids=["alone", "batch"])
@pytest.mark.parametrize("value", [2**31, 2**63], ids=["int8", "numeric"])
def test_bug_max_attempts_past_the_integer_column_is_an_invalid_job(count, value):
    with transaction.atomic():
        with pytest.raises(InvalidJob, match="max_attempts"):
            enqueue(count, max_attempts=value)
        # The caller's transaction is still usable: nothing ran.
        assert Job.objects.count() == 0
    with pytest.raises(InvalidJob, match="max_attempts"):
        enqueue(count, max_attempts=value)  # outside a transaction (the one-statement path)


# -- guards ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_guard_a_refused_statement_on_the_binding_cursor_is_djangos_integrity_error():
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


@pytest.mark.django_db(transaction=True)
def test_guard_nothing_is_prepared_on_a_bounded_connection_whatever_options_say():
    """PgBouncer in transaction mode: no statement the worker or the scheduler sends on a
    connection of their own (``dbbounds.bounded``) may be prepared, whatever
    ``prepare_threshold`` the project's ``OPTIONS`` set (0 prepares every statement at once)
    for its own connections, where the queue's statements follow it."""
    enqueue(40)
    with prepare_threshold(0), dbbounds.bounded(connection):
        for _ in range(8):
            [job] = claim(1)
            queue.record([Outcome.succeeded(job)])
            [job] = claim(1)
            queue.renew([job])
            queue.next_attempt(job)
            queue.record_and_claim([Outcome.succeeded(job)], [ClaimRequest(NAME, 1)], scope=SCOPE)
            queue.enqueue(NewJob(name=NAME, payload={}))
            queue.enqueue_many([NewJob(name=NAME, payload={})] * 2)
        assert prepared_statements() == 0


@pytest.mark.django_db
def test_guard_the_binding_cursor_goes_through_execute_wrappers_and_query_logging():
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


@pytest.mark.django_db
def test_guard_the_combined_pass_keeps_the_scope_of_the_claim(claim_form):
    """The outcome CTE is named ``o``, as is the override table in AllTenantsExcept's SQL: the
    scope must still refer to the overrides, under both forms of the claim."""
    scope = AllTenantsExcept("billing")
    TenantOverride.objects.create(tenant="acme", component="billing")
    queue.enqueue_many(
        [NewJob(name=NAME, payload={}, tenant="acme")] * 2
        + [NewJob(name=NAME, payload={}, tenant="other")] * 3
    )
    held = claim(1, scope=scope)

    report, claimed = queue.record_and_claim(
        [Outcome.succeeded(held[0])], [ClaimRequest(NAME, 10)], scope=scope
    )

    assert report.applied == (held[0].id,)
    assert {j.tenant for j in [*held, *claimed]} == {"other"} and len(claimed) == 2


@pytest.mark.django_db(transaction=True)
def test_guard_the_combined_pass_locks_only_the_rows_it_claims():
    """Inside a transaction the statement's row locks last until commit: only the rows it
    wrote or claimed may be locked, never queued rows the claim looked at and left."""
    ids = enqueue(6)
    [held] = claim(1)
    with transaction.atomic():
        _, claimed = queue.record_and_claim(
            [Outcome.succeeded(held)], [ClaimRequest(NAME, 5)], scope=SCOPE, limit=2
        )
        taken = {held.id, *(j.id for j in claimed)}
        left = [i for i in ids if i not in taken]

        def lock_the_rest() -> list[int]:
            try:
                with transaction.atomic():
                    return list(
                        Job.objects.select_for_update(nowait=True)
                        .filter(pk__in=left)
                        .values_list("pk", flat=True)
                    )
            finally:
                connection.close()

        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(lock_the_rest()))
        thread.start()
        thread.join(30)
    assert len(claimed) == 2 and len(left) == 3
    assert sorted(result[0]) == sorted(left)


@pytest.mark.django_db(transaction=True)
def test_guard_one_job_after_set_autocommit_false_stays_in_the_callers_transaction():
    transaction.set_autocommit(False)
    try:
        queue.enqueue(NewJob(name=NAME, payload={}))
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_guard_one_keyed_job_outside_a_transaction_releases_an_expired_holder():
    first = queue.enqueue(NewJob(name=NAME, payload={}, job_id="order-x"))
    [job] = claim(1)
    queue.record([Outcome.succeeded(job)])
    Job.objects.filter(pk=first.id).update(finished_at=datetime(2000, 1, 1, tzinfo=UTC))

    again = queue.enqueue(NewJob(name=NAME, payload={"n": 2}, job_id="order-x"))

    assert again.created and again.id != first.id
    assert Job.objects.get(pk=first.id).key_held is False
    assert Job.objects.get(pk=again.id).payload == {"n": 2}


@pytest.mark.django_db
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
def test_guard_due_times_with_use_tz_off_and_a_local_time_zone():
    """With USE_TZ=False the batch insert reads its clock back naive (in the session's zone,
    here New York) and sends it again for the due times: they must still be that clock."""
    queue.enqueue_many([NewJob(name=NAME, payload={}, delay=timedelta(hours=1))] * 2)
    queue.enqueue(NewJob(name=NAME, payload={}, delay=timedelta(hours=1)))
    with connection.cursor() as cur:
        cur.execute(
            "SELECT run_after - created_at, created_at BETWEEN now() AND clock_timestamp() "
            "FROM jobs_job"
        )
        rows = cur.fetchall()
    assert rows == [(timedelta(hours=1), True)] * 3


DELAYED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT 'later-' || g, %(name)s, '{}', 'default', 'default',
       CASE WHEN g <= 100 THEN -100 ELSE -99 + g %% 199 END, 5,
       CASE WHEN g <= 100 THEN now() - interval '1 minute'
            ELSE now() + interval '1 hour' + g * interval '1 second' END,
       'queued', 0, '', '', '', TRUE, '', now()
FROM generate_series(1, 60100) AS g
"""


def _nodes(node: dict) -> list[dict]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


@pytest.mark.django_db
def test_guard_the_scan_skips_through_many_priorities_without_statistics(claim_form):
    """199 priorities of delayed rows above the due ones, and no ANALYZE since they came: the
    claim still reads a few pages a priority, nothing in proportion to the 60,000 rows
    (measured: the scan about 650 buffers, the walk about 1,600; a full read is ~2,000)."""
    name = f"test.review14.{claim_form}.v1"
    with connection.cursor() as cur:
        cur.execute(DELAYED, {"name": name})
        sql, scope_params = claim_sql(AllTenantsExcept("worker"))
        params = {
            "names": [name],
            "limits": [50],
            "caps": [None],
            "total": 50,
            "lease": 10.0,
            "worker": "plan",
            **scope_params,
        }
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
        (plan,) = cur.fetchone()
    assert plan[0]["Plan"]["Actual Rows"] == 50
    (picked,) = [n for n in _nodes(plan[0]["Plan"]) if n.get("Subplan Name") == "CTE picked"]
    touched = picked["Shared Hit Blocks"] + picked["Shared Read Blocks"]
    assert touched < (1000 if claim_form == "scan" else 2500), (touched, plan)
