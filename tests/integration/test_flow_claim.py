"""Flow controls in the claim: global and tenant limits, rate buckets, tenant order."""

from __future__ import annotations

import pytest

from jobs import queue
from jobs.models import FlowGate, Job
from jobs.queue import AllTenants, ClaimRequest, NewJob, flow
from jobs.queue.flow import FlowLimits

pytestmark = pytest.mark.django_db

NAME = "test.flow.v1"


def enqueue(tenant: str, count: int, name: str = NAME) -> None:
    queue.enqueue_many([NewJob(name, {}, tenant=tenant) for _ in range(count)])


def take(limits: FlowLimits, asked: int = 50, after: dict | None = None, name: str = NAME):
    return queue.claim(
        [ClaimRequest(name, asked)], scope=AllTenants(), limits={name: limits}, after=after
    )


def test_global_limit_counts_running_jobs():
    limits = FlowLimits(global_concurrency=3)
    flow.ensure({NAME: limits})
    enqueue("a", 10)

    first = take(limits)
    assert len(first) == 3
    assert take(limits) == []
    queue.complete(first[0])
    assert len(take(limits)) == 1


def test_fair_claim_shares_between_tenants():
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    enqueue("a", 100)
    enqueue("b", 5)
    assert Job.objects.filter(fair=True).count() == 105

    claimed = take(limits, asked=20)
    tenants = [job.tenant for job in claimed]
    assert len(claimed) == 20
    assert tenants.count("b") == 5


def test_rate_bucket_takes_tokens():
    limits = FlowLimits(rate=1.0, burst=2.0)
    flow.ensure({NAME: limits})
    enqueue("a", 10)
    assert len(take(limits)) == 2
    assert take(limits) == []
    gate = FlowGate.objects.get(name=NAME)
    assert gate.version == 1 and gate.tokens < 1


def test_tenant_limit():
    limits = FlowLimits(tenant_concurrency=2)
    flow.ensure({NAME: limits})
    enqueue("a", 10)
    enqueue("b", 10)
    claimed = take(limits)
    assert sorted(job.tenant for job in claimed) == ["a", "a", "b", "b"]
