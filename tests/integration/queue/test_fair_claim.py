"""The fair claim: the top class it serves first, whatever limits the worker (its scope,
paused queues and tenants, rows out of attempts, the places kept for lower classes and the
jobs claimed), and what one claim reads, whatever the scope.

A claim's reads are counted in the transaction's own statistics (``pg_stat_xact_user_tables``):
index scans and the index entries they fetched from ``jobs_job``, which a plan that walks
more tenants than the claim serves, or another tenant's backlog, shows plainly.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import Job, TenantOverride
from jobs.queue import AllTenants, AllTenantsExcept, ClaimRequest, NewJob, OnlyTenant, flow
from jobs.queue.flow import FlowLimits
from jobs.queue.types import Scope

pytestmark = pytest.mark.django_db

NAME = "test.top.v1"
SCOPES = {
    "all": AllTenants(),
    "only-b": OnlyTenant("b"),
    "base": AllTenantsExcept("web"),  # tenant "c" is taken away from it
}
MODES = {
    "fair": FlowLimits(fair=True),
    "fair-gated": FlowLimits(fair=True, global_concurrency=10_000),
    "fair-share": FlowLimits(fair=True, lower_share=0.5),
    "plain-share": FlowLimits(lower_share=0.5),
}

# (tenant, priority, queue, due now, out of attempts) → how many queued jobs
rows = st.dictionaries(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from([-3, 0, 2, 5]),
        st.sampled_from(["q1", "q2"]),
        st.booleans(),
        st.booleans(),
    ),
    st.integers(1, 3),
    min_size=1,
)


def _eligible(scope: str, paused: tuple[str, ...], cap: int | None) -> list[int]:
    """The priorities of the rows this worker could start now, highest first (from the rows)."""
    now = timezone.now()
    out = []
    for job in Job.objects.filter(name=NAME, state="queued"):
        limit = job.max_attempts if cap is None else min(job.max_attempts, cap)
        if job.run_after > now or job.attempts >= limit:
            continue
        if (scope == "only-b" and job.tenant != "b") or (scope == "base" and job.tenant == "c"):
            continue
        if f"queue:{job.queue}" in paused or f"tenant:{job.tenant}" in paused:
            continue
        out.append(job.priority)
    return sorted(out, reverse=True)


def _expected(due: list[int], asked: int, reserve: int) -> list[int]:
    """The top class's rows after the places kept for the classes below, then the rest of
    the classes below in claim order."""
    if not due:
        return []
    top = [p for p in due if p == due[0]]
    below = due[len(top) :]
    low = min(reserve, len(below))
    from_top = min(len(top), asked - low)
    return top[:from_top] + below[: low + min(len(below) - low, asked - low - from_top)]


@example(
    backlog={("a", -3, "q1", True, False): 2, ("b", 5, "q1", True, False): 1},
    scope="only-b",
    paused=(),
    mode="fair",
    cap=None,
    running=1,
    asked=4,
)
@example(
    backlog={("a", 0, "q1", True, False): 2, ("b", -3, "q1", False, False): 1},
    scope="only-b",
    paused=(),
    mode="fair-share",
    cap=None,
    running=0,
    asked=4,
)
@given(
    backlog=rows,
    scope=st.sampled_from(sorted(SCOPES)),
    paused=st.sampled_from([(), ("queue:q2",), ("tenant:a",), ("queue:q1", "tenant:b")]),
    mode=st.sampled_from(sorted(MODES)),
    cap=st.sampled_from([None, 2]),
    running=st.integers(0, 3),
    asked=st.integers(1, 8),
)
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_a_claim_serves_the_highest_class_the_worker_may_start_first(
    claim_form, backlog, scope, paused, mode, cap, running, asked
):
    limits = MODES[mode]
    later = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        flow.ensure({NAME: limits})
        TenantOverride.objects.create(tenant="c", component="web")
        for (tenant, priority, queue_name, due, spent), count in backlog.items():
            ids = queue.enqueue_many(
                [
                    NewJob(
                        NAME,
                        {},
                        tenant=tenant,
                        queue=queue_name,
                        priority=priority,
                        run_after=None if due else later,
                        max_attempts=5,
                    )
                    for _ in range(count)
                ]
            )
            if spent:  # run before, and out of attempts (own limit) or past the worker's (2)
                Job.objects.filter(id__in=[r.id for r in ids]).update(
                    attempts=5 if priority % 2 else 2
                )
        if running:  # another worker's claim, of every tenant
            queue.claim([ClaimRequest(NAME, running)], scope=AllTenants(), worker="other")
        for kind_value in paused:
            kind, value = kind_value.split(":")
            queue.pause(kind, value, by="test")
        due = _eligible(scope, paused, cap)

        claimed = queue.claim(
            [ClaimRequest(NAME, asked, max_attempts=cap)],
            scope=SCOPES[scope],
            limits={NAME: limits},
        )

        got = sorted((job.priority for job in claimed), reverse=True)
        kept = asked * (limits.lower_share or 0)  # whole places, and one more that often
        allowed = [_expected(due, asked, r) for r in {math.floor(kept), math.ceil(kept)}]
        assert got in allowed, (got, due)
        transaction.set_rollback(True)


@pytest.mark.parametrize("left", [1000, 10])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_claim_of_one_class_crosses_the_claimed_jobs_once(claim_form, mode, left, monkeypatch):
    from django.db import connection

    from tests.support.enqueue import inserted_row_by_row
    from tests.support.explain import explained_claim

    limits = MODES[mode]
    # A name of its own: rows the tests before left dead in the table (rolled back) must not
    # sit in the part of the index this test reads.
    name = f"test.crossing.{mode}.{left}.v1"
    inserted_row_by_row(monkeypatch)
    flow.ensure({name: limits})
    queue.enqueue_many([NewJob(name, {}, tenant="a") for _ in range(2000 + left)])
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_job")

    def take(asked: int):
        return queue.claim([ClaimRequest(name, asked)], scope=AllTenants(), limits={name: limits})

    with transaction.atomic():
        assert len(take(1000) + take(1000)) == 2000
        claimed, nodes = explained_claim(lambda: take(50))
    assert len(claimed) == min(50, left)
    reads = [
        (n.get("Index Cond"), n["Shared Hit Blocks"] + n["Shared Read Blocks"])
        for n in nodes
        # Reads of an index (a small table's join may be planned as a scan of it: not this).
        if n.get("Relation Name") == "jobs_job" and "Index Name" in n
    ]
    # The 2,000 claimed entries span hundreds of pages: only the pull crosses them, and in the
    # plain claim's priority walk before PostgreSQL 18 its first hop may too (whether it does
    # depends on which of those entries earlier scans have already found dead).
    crossings = [read for read in reads if read[1] > 200]
    most = 2 if mode == "plain-share" and claim_form == "walk" else 1
    assert 1 <= len(crossings) <= most, crossings


PICK_NAME = "test.fair-pick.v1"


FAIR = FlowLimits(fair=True)


def claim_reads(
    asked: int, scope: Scope, after: str = "", limits: FlowLimits = FAIR
) -> tuple[list[str], int, int]:
    """The tenants of one claim's jobs, and the index scans and entries it read."""

    def counts() -> tuple[int, int]:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT COALESCE(idx_scan, 0), COALESCE(idx_tup_fetch, 0)"
                " FROM pg_stat_xact_user_tables WHERE relname = 'jobs_job'"
            )
            return cur.fetchone()

    with transaction.atomic():
        scans, fetched = counts()
        jobs = queue.claim(
            [ClaimRequest(PICK_NAME, asked)],
            scope=scope,
            limits={PICK_NAME: limits},
            after={PICK_NAME: after},
        )
        scans_after, fetched_after = counts()
    return [job.tenant for job in jobs], scans_after - scans, fetched_after - fetched


@pytest.mark.parametrize(
    "limits", [FAIR, FlowLimits(fair=True, tenant_concurrency=5)], ids=["function", "inline"]
)
def test_a_claim_of_two_walks_a_few_tenants_not_all_of_them(limits):
    # Whether more than one tenant is read must not need the whole list of tenants: a
    # claim of 2 among 300 tenants reads about 2 of them (before the one-tenant shortcut it
    # read 10 index scans here; a walk of every tenant is over 300). The same holds for the
    # inline pick of types with tenant limits, built from the same SQL.
    flow.ensure({PICK_NAME: limits})
    queue.enqueue_many(
        [NewJob(PICK_NAME, {}, tenant=f"t{i:04d}") for i in range(300) for _ in range(2)]
    )
    tenants, scans, _ = claim_reads(2, AllTenants(), after="t0150", limits=limits)
    assert sorted(tenants) == ["t0148", "t0149"]
    assert scans < 60, f"{scans} index scans for a claim of 2"
