"""The worker's pass as a function (``jobs_worker_pass_v3``): the statement a worker runs every
pass for job types without flow controls, with a plan each connection keeps.

It must write and claim exactly what the inline statement did: what ``record()`` then
``claim()`` would, but for jobs the pass itself puts back in the queue (both parts read one
snapshot). These tests compare the two on generated backlogs, outcomes and scopes.
"""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import Job, TenantOverride
from jobs.queue import (
    AllTenants,
    AllTenantsExcept,
    ClaimRequest,
    NewJob,
    OnlyTenant,
    Outcome,
    cycle,
    flow,
)
from jobs.queue.flow import FlowLimits

pytestmark = pytest.mark.django_db

NAMES = ("test.pass.a.v1", "test.pass.b.v1")
SCOPES = {
    "all": AllTenants(),
    "only b": OnlyTenant("b"),
    "base of web": AllTenantsExcept("web"),  # tenant c has a web override
}


def _state() -> list[tuple]:
    return sorted(
        Job.objects.values_list(
            "id", "state", "attempts", "claimed_by", "last_error", "result", "key_held"
        )
    )


def _outcome(kind: str, job, fenced: bool) -> Outcome:
    outcome = {
        "succeeded": lambda: Outcome.succeeded(job, {"n": job.id}),
        "failed": lambda: Outcome.failed(job, code="boom", detail="it broke"),
        "retry": lambda: Outcome.retry(job, code="later", delay=timedelta(minutes=5)),
        "cancelled": lambda: Outcome.cancelled(job),
    }[kind]()
    if fenced:  # another worker's claim since: this attempt's token no longer holds the row
        Job.objects.filter(pk=job.id).update(claim_token=None, state="queued")
    return outcome


backlogs = st.lists(
    st.tuples(st.sampled_from(NAMES), st.sampled_from("abc"), st.sampled_from([0, 3])),
    min_size=0,
    max_size=14,
)
outcome_kinds = st.lists(
    st.tuples(st.sampled_from(["succeeded", "failed", "retry", "cancelled"]), st.booleans()),
    max_size=6,
)


@example(
    backlog=[(NAMES[0], "a", 0)] * 4, kinds=[("succeeded", False)] * 2, scope="all", asked=(3, 2)
)
@given(
    backlog=backlogs,
    kinds=outcome_kinds,
    scope=st.sampled_from(sorted(SCOPES)),
    asked=st.tuples(st.integers(0, 6), st.integers(0, 6)),
)
@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_the_pass_writes_and_claims_what_record_then_claim_would(
    claim_form, backlog, kinds, scope, asked
):
    with transaction.atomic():
        TenantOverride.objects.create(tenant="c", component="web")
        for name, tenant, priority in backlog:
            queue.enqueue(NewJob(name, {}, tenant=tenant, priority=priority))
        held = queue.claim([ClaimRequest(NAMES[0], len(kinds))], scope=AllTenants(), worker="w")
        outcomes = [
            _outcome(kind, job, fenced) for (kind, fenced), job in zip(kinds, held, strict=False)
        ]
        requests = [ClaimRequest(name, n) for name, n in zip(NAMES, asked, strict=True)]

        with transaction.atomic():
            expected_report = queue.record(outcomes, count=False)
            expected = queue.claim(requests, scope=SCOPES[scope], limit=7, worker="w2")
            expected_state = _state()
            transaction.set_rollback(True)

        with CaptureQueriesContext(connection) as statements:
            report, claimed = queue.record_and_claim(
                outcomes, requests, scope=SCOPES[scope], limit=7, worker="w2", count=False
            )

        if sum(asked):  # with or without outcomes: one call of the function
            assert [s["sql"].split("(", 1)[0] for s in statements] == [
                "SELECT * FROM jobs_worker_pass_v3"
            ]
        assert report == expected_report
        assert [(j.id, j.attempts, j.max_attempts) for j in claimed] == [
            (j.id, j.attempts, j.max_attempts) for j in expected
        ]
        tokens = {j.id: j.claim_token for j in claimed}
        # Everything but the fresh claim tokens is what the two statements wrote.
        assert _state() == expected_state
        assert all(Job.objects.get(pk=i).claim_token == token for i, token in tokens.items())
        transaction.set_rollback(True)


def test_the_pass_leaves_paused_names_queues_and_tenants_alone():
    for tenant in ("a", "b"):
        for queue_name in ("default", "slow"):
            queue.enqueue(NewJob(NAMES[0], {}, tenant=tenant, queue=queue_name))
    queue.enqueue(NewJob(NAMES[1], {}, tenant="a"))
    queue.enqueue(NewJob(NAMES[0], {}, tenant="d"))
    [done] = queue.claim([ClaimRequest(NAMES[0], 1)], scope=OnlyTenant("d"))
    queue.pause("queue", "slow", by="test")
    queue.pause("tenant", "b", by="test")
    queue.pause("job_type", NAMES[1], by="test")

    with CaptureQueriesContext(connection) as statements:
        report, claimed = queue.record_and_claim(
            [Outcome.succeeded(done)],
            [ClaimRequest(n, 10) for n in NAMES],
            scope=AllTenants(),
            count=False,
        )

    assert "jobs_worker_pass" in statements[0]["sql"] and report.applied == (done.id,)
    assert [(j.name, j.tenant, j.queue) for j in claimed] == [(NAMES[0], "a", "default")]


FAIR = {NAMES[0]: FlowLimits(fair=True), NAMES[1]: FlowLimits(fair=True, lower_share=0.25)}


@example(
    backlog=[(NAMES[0], "a", 0)] * 5 + [(NAMES[0], "b", 0)],
    kinds=[],
    scope="all",
    asked=(3, 0),
    cursor="",
)
@example(  # the lower-class share's random rounding: once unequal before the seed was set
    backlog=[
        (NAMES[1], tenant, priority)
        for tenant, priority in (("a", 0), ("a", 3), ("b", 3), ("a", 3), ("b", 0))
    ],
    kinds=[],
    scope="base of web",
    asked=(3, 3),
    cursor="",
)
@given(
    backlog=backlogs,
    kinds=outcome_kinds,
    scope=st.sampled_from(sorted(SCOPES)),
    asked=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    cursor=st.sampled_from(["", "a", "b", "c"]),
)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_the_fair_pass_writes_and_claims_what_record_then_claim_would(
    backlog, kinds, scope, asked, cursor
):
    # Both names fair (one keeping a share for lower classes): the pass is one call of
    # jobs_worker_fair_pass_v3, and must do what the inline statement it replaces does (outcomes
    # and the fair claim in one snapshot, where the jobs it ends still count as running).
    with transaction.atomic():
        flow.ensure(FAIR)
        TenantOverride.objects.create(tenant="c", component="web")
        for name, tenant, priority in backlog:
            queue.enqueue(NewJob(name, {}, tenant=tenant, priority=priority))
        held = queue.claim(
            [ClaimRequest(NAMES[0], len(kinds))], scope=AllTenants(), worker="w", limits=FAIR
        )
        outcomes = [
            _outcome(kind, job, fenced) for (kind, fenced), job in zip(kinds, held, strict=False)
        ]
        requests = [ClaimRequest(name, n) for name, n in zip(NAMES, asked, strict=True)]
        after = {NAMES[0]: cursor, NAMES[1]: cursor}
        options = {"scope": SCOPES[scope], "limit": 7, "worker": "w2", "limits": FAIR}

        # The lower-class share rounds at random (jobs_fair_pick): the same seed for both.
        seed = "SELECT setseed(0.25)"
        with transaction.atomic(), mock.patch.object(cycle, "TIERED_FORM", None):
            connection.cursor().execute(seed)
            expected_report, expected = queue.record_and_claim(
                outcomes, requests, count=False, after=after, **options
            )
            expected_state = _state()
            transaction.set_rollback(True)

        connection.cursor().execute(seed)
        with CaptureQueriesContext(connection) as statements:
            report, claimed = queue.record_and_claim(
                outcomes, requests, count=False, after=after, **options
            )

        if sum(asked):
            assert [s["sql"].split("(", 1)[0] for s in statements] == [
                "SELECT * FROM jobs_worker_fair_pass_v3"
            ]
        assert report == expected_report
        assert [(j.id, j.tenant, j.attempts, j.max_attempts) for j in claimed] == [
            (j.id, j.tenant, j.attempts, j.max_attempts) for j in expected
        ]
        assert _state() == expected_state
        transaction.set_rollback(True)


@pytest.mark.parametrize("with_outcome", [False, True])
def test_a_fair_type_claims_in_tenant_order_with_or_without_outcomes(with_outcome):
    # A fair type has flow controls but nothing to add after the claim: the pass must take
    # the flow claim all the same, not the function's plain order (oldest first: all "a").
    limits = {NAMES[0]: FlowLimits(fair=True)}
    flow.ensure(limits)
    for tenant, count in (("a", 30), ("b", 3)):
        for _ in range(count):
            queue.enqueue(NewJob(NAMES[0], {}, tenant=tenant))
    queue.enqueue(NewJob(NAMES[1], {}))  # the outcome is another type's
    held = queue.claim([ClaimRequest(NAMES[1], 1)], scope=AllTenants())
    outcomes = [Outcome.succeeded(held[0])] if with_outcome else []

    report, claimed = queue.record_and_claim(
        outcomes,
        [ClaimRequest(NAMES[0], 6)],
        scope=AllTenants(),
        limit=6,
        worker="w",
        count=False,
        limits=limits,
    )

    assert [job.tenant for job in claimed].count("b") == 3
    assert report.applied == ((held[0].id,) if with_outcome else ())
