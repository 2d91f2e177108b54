"""The fair pick function (``jobs_fair_pick``): what one claim reads, whatever the scope.

A claim's reads are counted in the transaction's own statistics (``pg_stat_xact_user_tables``):
index scans and the index entries they fetched from ``jobs_job``, which a plan that walks
more tenants than the claim serves, or another tenant's backlog, shows plainly.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob, flow
from jobs.queue.flow import FlowLimits
from jobs.queue.types import Scope

pytestmark = pytest.mark.django_db

NAME = "test.fair-pick-review.v1"
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
            [ClaimRequest(NAME, asked)], scope=scope, limits={NAME: limits}, after={NAME: after}
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
    flow.ensure({NAME: limits})
    queue.enqueue_many([NewJob(NAME, {}, tenant=f"t{i:04d}") for i in range(300) for _ in range(2)])
    tenants, scans, _ = claim_reads(2, AllTenants(), after="t0150", limits=limits)
    assert sorted(tenants) == ["t0148", "t0149"]
    assert scans < 60, f"{scans} index scans for a claim of 2"
