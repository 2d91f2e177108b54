"""Tenant weights hold over time: each tenant's share of a fair type's starts follows its
weight whatever the size of the claims, while every tenant has due jobs."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Mapping

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import FairAccount, TenantOverride, TenantWeight
from jobs.queue import AllTenants, AllTenantsExcept, ClaimRequest, NewJob, OnlyTenant, flow
from jobs.queue.flow import FlowLimits
from jobs.queue.types import Outcome

pytestmark = pytest.mark.django_db

NAME = "test.fair_weights.v1"
WEIGHTS = {"a": 1, "b": 1, "c": 3}


def backlog(weights: Mapping[str, int], depth: int, name: str = NAME) -> None:
    """``depth`` due jobs for each tenant, and the tenants' weights."""
    TenantWeight.objects.bulk_create(
        [TenantWeight(tenant=t, weight=w) for t, w in weights.items()], ignore_conflicts=True
    )
    for tenant in weights:
        queue.enqueue_many([NewJob(name, {}, tenant=tenant) for _ in range(depth)])


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
#: The claim's three forms: the flow statement, the worker's pass (jobs_worker_fair_pass),
#: and the flow statement through the gate of a global limit.
FORMS = {
    "claim": (FlowLimits(fair=True), False),
    "worker pass": (FlowLimits(fair=True), True),
    "global limit": (FlowLimits(fair=True, global_concurrency=200), False),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("size", sorted(SIZES))
def test_weights_hold_over_time_whatever_the_claim_size(size, form):
    limits, through_pass = FORMS[form]
    flow.ensure({NAME: limits})
    backlog(WEIGHTS, depth=1_200)
    rng = random.Random(7)

    claims = drive(limits, lambda: SIZES[size](rng), starts=1_000, through_pass=through_pass)

    off = shares_off(claims, WEIGHTS)
    ratio = sum(c["c"] for c in claims) / sum(c["a"] for c in claims)
    assert all(abs(r - 1) <= 0.05 for r in off.values()), (off, f"c/a {ratio:.2f}")
    # Not only on the whole: over every stretch of 200 starts too.
    assert worst_window(claims, WEIGHTS, least=200) <= 0.05, f"c/a {ratio:.2f}"
    # Every start is on its tenant's account.
    accounts = dict(FairAccount.objects.filter(name=NAME).values_list("tenant", "starts"))
    assert accounts == dict(sum(claims, Counter()))


def accounts(name: str = NAME) -> dict[str, float | None]:
    """Each tenant's account: its starts so far per unit of weight (None: at rest)."""
    return dict(FairAccount.objects.filter(name=name).values_list("tenant", "served"))


def test_a_tenant_with_nothing_due_banks_no_credit():
    """A tenant whose account a claim finds with nothing due comes to rest, and comes back
    level with the least served: it does not take every start until it has caught up with
    the tenants that ran meanwhile."""
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    backlog({"a": 1, "b": 1}, depth=200)
    FairAccount.objects.bulk_create(
        [FairAccount(name=NAME, tenant=t, served=s) for t, s in (("a", 100), ("b", 100), ("c", 0))]
    )

    drive(limits, lambda: 3, starts=3)
    assert accounts()["c"] is None  # read first (least served), nothing due: at rest

    backlog({"c": 1}, depth=50)
    claims = drive(limits, lambda: 3, starts=90)

    # Its share of the 90 (within one: it comes in level with the least served), not all.
    assert abs(sum(claims, Counter())["c"] - 30) <= 1
    assert accounts()["c"] == pytest.approx(accounts()["a"], abs=1)


def test_a_worker_of_one_tenant_claims_it_however_served_its_account():
    """A worker started for one tenant serves it even when its account comes after every
    account a claim reads, least served first."""
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    tenants = {f"t{i:02d}": 1 for i in range(40)}
    backlog(tenants, depth=2)
    FairAccount.objects.bulk_create(
        [FairAccount(name=NAME, tenant=t, served=float(i)) for i, t in enumerate(tenants)]
    )

    claimed = queue.claim([ClaimRequest(NAME, 1)], scope=OnlyTenant("t39"), limits={NAME: limits})

    assert [job.tenant for job in claimed] == ["t39"]
    assert accounts() == {t: float(i) + (i == 39) for i, t in enumerate(tenants)}


def test_a_base_worker_leaves_the_accounts_of_tenants_it_does_not_serve():
    """A tenant taken from the base workers (its own workers serve it) keeps its account:
    the base workers read it, least served, but neither serve it nor put it to rest."""
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    backlog({"a": 1, "b": 1, "branch": 1}, depth=5)
    TenantOverride.objects.create(tenant="branch", component="base")
    FairAccount.objects.bulk_create(
        [FairAccount(name=NAME, tenant=t, served=s) for t, s in (("branch", 0), ("a", 5), ("b", 5))]
    )

    claimed = queue.claim(
        [ClaimRequest(NAME, 4)], scope=AllTenantsExcept("base"), limits={NAME: limits}
    )

    assert Counter(job.tenant for job in claimed) == {"a": 2, "b": 2}
    assert accounts() == {"branch": 0, "a": 7, "b": 7}


STARTS = 240


@given(
    weights=st.lists(st.integers(1, 10), min_size=2, max_size=5),
    sizes=st.one_of(
        st.lists(st.integers(1, 60), min_size=1, max_size=1),  # one size throughout
        st.lists(st.integers(1, 8), min_size=2, max_size=6),  # small claims of mixed sizes
        st.lists(st.integers(1, 60), min_size=2, max_size=6),
    ),
    through_pass=st.booleans(),
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_weights_hold_over_time_for_any_claim_sizes(weights, sizes, through_pass):
    tenants = {f"t{i}": w for i, w in enumerate(weights)}
    limits = FlowLimits(fair=True)
    with transaction.atomic():
        flow.ensure({NAME: limits})
        backlog(tenants, depth=STARTS + 60)  # every tenant has due jobs throughout
        cycle = itertools.cycle(sizes)

        claims = drive(limits, lambda: next(cycle), STARTS, through_pass=through_pass)

        got = sum(claims, Counter())
        total = sum(got.values())
        weight = sum(weights)
        for tenant, w in tenants.items():
            expected = total * w / weight
            # Within one start per tenant: tenants level with each other are served one after
            # another, and one found by the rotation comes in level with the least served.
            assert abs(got[tenant] - expected) <= len(tenants), (tenant, got, tenants)
        transaction.set_rollback(True)


OTHER = "test.fair_weights.other.v1"


@pytest.mark.django_db(transaction=True)
def test_concurrent_passes_of_two_fair_types_keep_the_weights_and_never_deadlock(threads):
    """Three workers' passes at once, each over two fair types in its own rotation: the
    accounts are written in one order by every claim, so none waits for another in a cycle
    (PostgreSQL would end one with a deadlock error), and each type's shares hold."""
    limits = {NAME: FlowLimits(fair=True), OTHER: FlowLimits(fair=True)}
    flow.ensure(limits)
    for name in limits:
        backlog(WEIGHTS, depth=800, name=name)  # more than any tenant takes

    def worker(index: int) -> Counter[tuple[str, str]]:
        rng = random.Random(index)
        names = [NAME, OTHER] if index % 2 else [OTHER, NAME]
        after: dict[str, str] = {}
        held: list[queue.ClaimedJob] = []
        started: Counter[tuple[str, str]] = Counter()
        for turn in range(100):
            rotation = names[turn % 2 :] + names[: turn % 2]
            _, held = queue.record_and_claim(
                [Outcome.succeeded(job) for job in held],
                [ClaimRequest(name, rng.randint(2, 4)) for name in rotation],
                scope=AllTenants(),
                count=False,
                limits=limits,
                after=after,
            )
            for name in limits:
                tenants = [job.tenant for job in held if job.name == name]
                after[name] = flow.next_cursor(after.get(name, ""), tenants)
            started.update((job.name, job.tenant) for job in held)
        return started

    started = sum(threads(3, worker, timeout=120), Counter())

    accounts = {
        (name, tenant): starts
        for name, tenant, starts in FairAccount.objects.values_list("name", "tenant", "starts")
    }
    assert accounts == dict(started)
    for name in limits:
        counts = [Counter({t: n for (m, t), n in started.items() if m == name})]
        assert all(abs(r - 1) <= 0.05 for r in shares_off(counts, WEIGHTS).values()), counts
