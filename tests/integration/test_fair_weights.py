"""Tenant weights hold over time: each tenant's share of a fair type's starts follows its
weight whatever the size of the claims, while every tenant has due jobs."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import TenantWeight
from jobs.queue import AllTenants, ClaimRequest, NewJob, flow
from jobs.queue.flow import FlowLimits
from jobs.queue.types import Outcome

pytestmark = pytest.mark.django_db

NAME = "test.fair_weights.v1"
WEIGHTS = {"a": 1, "b": 1, "c": 3}


def backlog(weights: Mapping[str, int], depth: int) -> None:
    """``depth`` due jobs for each tenant, and the tenants' weights."""
    TenantWeight.objects.bulk_create(TenantWeight(tenant=t, weight=w) for t, w in weights.items())
    for tenant in weights:
        queue.enqueue_many([NewJob(NAME, {}, tenant=tenant) for _ in range(depth)])


def drive(
    limits: FlowLimits, sizes: Callable[[], int], starts: int, *, through_pass: bool = False
) -> list[Counter[str]]:
    """Claim as a worker does (its tenant cursor carried from claim to claim) until ``starts``
    jobs have started, ending each claim's jobs before the next; the tenants of each claim."""
    after: dict[str, str] = {}
    claims: list[Counter[str]] = []
    held: list[queue.ClaimedJob] = []
    total = 0
    while total < starts:
        request = [ClaimRequest(NAME, sizes())]
        if through_pass:  # the worker's pass: the last claim's outcomes and the next claim
            _, claimed = queue.record_and_claim(
                [Outcome.succeeded(job) for job in held],
                request,
                scope=AllTenants(),
                count=False,
                limits={NAME: limits},
                after=after,
            )
        else:
            if held:
                queue.record([Outcome.succeeded(job) for job in held], count=False)
            claimed = queue.claim(request, scope=AllTenants(), limits={NAME: limits}, after=after)
        assert claimed, "a claim with due jobs of every tenant took none"
        tenants = [job.tenant for job in claimed]
        after[NAME] = flow.next_cursor(after.get(NAME, ""), tenants)
        claims.append(Counter(tenants))
        held = claimed
        total += len(claimed)
    return claims


def shares_off(claims: list[Counter[str]], weights: Mapping[str, int]) -> dict[str, float]:
    """Each tenant's starts against its weight's share of them (1.0: exactly its share)."""
    got = sum(claims, Counter())
    total = sum(got.values())
    weight = sum(weights.values())
    return {t: got[t] / (total * w / weight) for t, w in weights.items()}


def worst_window(claims: list[Counter[str]], weights: Mapping[str, int], least: int) -> float:
    """The largest departure from the weights' shares over any run of whole claims of at
    least ``least`` starts."""
    worst = 0.0
    for start in range(len(claims)):
        window: Counter[str] = Counter()
        for claim in claims[start:]:
            window += claim
            if sum(window.values()) >= least:
                worst = max(worst, *(abs(r - 1) for r in shares_off([window], weights).values()))
                break
    return worst


SIZES = {
    "claims of 1": lambda rng: 1,
    "claims of 2-4": lambda rng: rng.randint(2, 4),
    "claims of 50": lambda rng: 50,
}


@pytest.mark.parametrize("through_pass", [False, True], ids=["claim", "worker pass"])
@pytest.mark.parametrize("global_limit", [None, 200], ids=["fair", "fair with a global limit"])
@pytest.mark.parametrize("size", sorted(SIZES))
def test_weights_hold_over_time_whatever_the_claim_size(size, global_limit, through_pass):
    limits = FlowLimits(fair=True, global_concurrency=global_limit)
    flow.ensure({NAME: limits})
    backlog(WEIGHTS, depth=1_500)
    rng = random.Random(7)

    claims = drive(limits, lambda: SIZES[size](rng), starts=1_000, through_pass=through_pass)

    off = shares_off(claims, WEIGHTS)
    ratio = sum(c["c"] for c in claims) / sum(c["a"] for c in claims)
    assert all(abs(r - 1) <= 0.05 for r in off.values()), (off, f"c/a {ratio:.2f}")
    # Not only on the whole: over every stretch of 200 starts too.
    assert worst_window(claims, WEIGHTS, least=200) <= 0.05, f"c/a {ratio:.2f}"
