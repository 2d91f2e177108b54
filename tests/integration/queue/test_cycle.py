"""record_and_claim: a worker's pass (outcomes, then the next claim) as one statement.

It must report and claim exactly what record() then claim() would, commit both or neither,
and cost one round trip with no transaction control outside a transaction.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from jobs import queue
from jobs.models import Job, TenantOverride
from jobs.queue import (
    AllTenantsExcept,
    ClaimRequest,
    NewJob,
    Outcome,
    _db,
)
from jobs.queue import outcomes as outcomes_module
from tests.support.concurrency import Background
from tests.support.enqueue import TransactionControl
from tests.support.noop_jobs import NAME, SCOPE, claim, enqueue


@pytest.mark.django_db(transaction=True)
def test_outcomes_and_the_next_claim_are_one_statement_without_begin_or_commit(monkeypatch):
    enqueue(5)
    held = claim(2)
    control = TransactionControl(monkeypatch)

    with CaptureQueriesContext(connection) as statements:
        report, claimed = queue.record_and_claim(
            [Outcome.succeeded(held[0], {"ok": 1}), Outcome.failed(held[1], code="boom")],
            [ClaimRequest(NAME, 10)],
            scope=SCOPE,
            limit=2,
            worker="w2",
        )

    assert len(statements) == 1 and control.begun == 0
    assert report.applied == (held[0].id, held[1].id) and not report.fenced
    assert len(claimed) == 2 and {j.id for j in claimed}.isdisjoint({h.id for h in held})
    states = dict(Job.objects.values_list("id", "state"))
    assert (states[held[0].id], states[held[1].id]) == ("succeeded", "failed")
    assert all(states[j.id] == "running" for j in claimed)
    assert Job.objects.get(pk=held[0].id).result == {"ok": 1}


@pytest.mark.django_db
def test_it_reports_and_claims_as_record_then_claim_would():
    ids = enqueue(6)
    first = claim(3)
    stale = Outcome.succeeded(first[2], None)
    queue.record([Outcome.retry(first[2], code="again", delay=0)])  # its token is gone now

    report, claimed = queue.record_and_claim(
        [Outcome.succeeded(first[0], 1), Outcome.retry(first[1], code="x", delay=0), stale],
        [ClaimRequest(NAME, 10)],
        scope=SCOPE,
    )

    assert report.applied == (first[0].id, first[1].id)
    assert report.fenced == (first[2].id,) and report.busy == ()
    # In claim order (the job requeued before is due last); the job this statement put back
    # is not among them (both parts read one snapshot): the next claim gets it.
    assert [j.id for j in claimed] == [*ids[3:], first[2].id]
    assert claim(10)[0].id == first[1].id


@pytest.mark.django_db
def test_with_nothing_to_claim_it_only_writes_and_with_nothing_to_write_it_only_claims():
    enqueue(2)
    [job] = claim(1)

    report, claimed = queue.record_and_claim([Outcome.succeeded(job)], [], scope=SCOPE)
    assert report.applied == (job.id,) and claimed == []

    report, claimed = queue.record_and_claim([], [ClaimRequest(NAME, 5)], scope=SCOPE)
    assert report.applied == () and len(claimed) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("count", [True, False], ids=["statement", "worker function"])
def test_a_row_another_session_holds_locked_is_busy_and_the_rest_goes_on(count):
    enqueue(3)
    held = claim(2)
    locked, release = threading.Event(), threading.Event()

    def hold_row_lock() -> None:
        with transaction.atomic():
            Job.objects.select_for_update().get(pk=held[0].id)
            locked.set()
            release.wait(30)

    holder = Background(hold_row_lock)
    assert locked.wait(30)
    try:
        report, claimed = queue.record_and_claim(
            [Outcome.succeeded(h) for h in held], [ClaimRequest(NAME, 5)], scope=SCOPE, count=count
        )
    finally:
        release.set()
        holder.result()

    assert report.busy == (held[0].id,) and report.applied == (held[1].id,)
    assert len(claimed) == 1
    assert Job.objects.get(pk=held[0].id).state == "running"


@pytest.mark.django_db(transaction=True)
def test_a_refused_outcome_writes_nothing_and_claims_nothing():
    enqueue(3)
    [job] = claim(1)
    # A state the table's check constraint refuses: the whole statement fails.
    refused = Outcome(id=job.id, token=job.claim_token, state="bogus")  # type: ignore[arg-type]

    with pytest.raises(DatabaseError):
        queue.record_and_claim([refused], [ClaimRequest(NAME, 5)], scope=SCOPE, worker="w")

    assert Job.objects.filter(state="running").count() == 1
    assert Job.objects.filter(state="queued").count() == 2


@pytest.mark.django_db
def test_inside_a_transaction_it_joins_it():
    enqueue(2)
    [job] = claim(1)

    with transaction.atomic():
        queue.record_and_claim(
            [Outcome.succeeded(job)], [ClaimRequest(NAME, 5)], scope=SCOPE, lease=timedelta(1)
        )
        transaction.set_rollback(True)

    assert Job.objects.get(pk=job.id).state == "running"
    assert Job.objects.filter(state="queued").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_batch_written_whole_does_not_look_for_busy_rows():
    """When every outcome was written none can be busy, and the statement does not compare
    each outcome with every written one to find that out (a cost in the square of the batch:
    about 6 % of PostgreSQL's CPU in passes of 100)."""
    enqueue(50)
    held = claim(50)
    outcomes = [Outcome.succeeded(h) for h in held]

    with _db.bound_cursor(None) as cur:
        cur.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + outcomes_module._RECORD[False],
            outcomes_module.outcome_params(outcomes, "default"),
        )
        (plan,) = cur.fetchone()

    assert Job.objects.filter(state="succeeded").count() == 50
    # The busy rows are the outcomes not among the written ones (an anti join, or from
    # PostgreSQL 16 maybe a right anti join): not run.
    anti = [n for n in _nodes(plan[0]["Plan"]) if n.get("Join Type", "").endswith("Anti")]
    assert anti and all(n["Actual Loops"] == 0 for n in anti), json.dumps(plan, indent=1)


def _nodes(node: dict) -> list[dict]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


@pytest.mark.django_db
def test_the_combined_pass_keeps_the_scope_of_the_claim(claim_form):
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
def test_the_combined_pass_locks_only_the_rows_it_claims():
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
