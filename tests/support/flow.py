"""Job types under every kind of flow control, and a queue holding each limit in force, for
the flow page's tests (its view, its gauges and its browser test)."""

from __future__ import annotations

from jobs import JobContext, Payload, Rate, queue
from jobs.admin import flow as page
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import TenantWeight
from jobs.queue import AllTenants, ClaimedJob, ClaimRequest, NewJob, flow

GATED, RATED, FAIR, PER_TENANT, PLAIN = (
    "flowpage.gated.v1",
    "flowpage.rated.v1",
    "flowpage.fair.v1",
    "flowpage.tenant.v1",
    "flowpage.plain.v1",
)


class GatedV1(Payload, name=GATED):
    n: int = 0


class RatedV1(Payload, name=RATED):
    n: int = 0


class FairV1(Payload, name=FAIR):
    n: int = 0


class PerTenantV1(Payload, name=PER_TENANT):
    n: int = 0


class PlainV1(Payload, name=PLAIN):
    n: int = 0


def handler(payload: Payload, ctx: JobContext) -> None:
    return None


def flow_registry() -> Registry:
    """Four types with flow control and one without (a handler may still throttle it)."""
    return Registry(
        [
            JobType(GatedV1, handler, Policy(global_concurrency=2)),
            # One token, refilled once a minute: one start empties the bucket.
            JobType(RatedV1, handler, Policy(rate_limit=Rate(1, per=60))),
            JobType(FairV1, handler, Policy(fair=True)),
            JobType(PerTenantV1, handler, Policy(tenant_concurrency=1)),
            JobType(PlainV1, handler, Policy()),
        ]
    )


def limits_of(registry: Registry) -> dict[str, flow.FlowLimits]:
    return page.controlled(registry)


def enqueue(name: str, count: int, tenant: str = "default") -> None:
    queue.enqueue_many([NewJob(name, {"n": i}, tenant=tenant) for i in range(count)])


def claim(registry: Registry, name: str, asked: int = 50) -> list[ClaimedJob]:
    return queue.claim([ClaimRequest(name, asked)], scope=AllTenants(), limits=limits_of(registry))


def seed_limits_in_force(registry: Registry) -> dict[str, list[ClaimedJob]]:
    """Every kind of limit holding due jobs back, and a throttle:

    * gated: 2 of 2 running, 3 due;
    * rated: its one token taken, 2 due;
    * fair: tenants acme (weight 3) and bolt with 6 and 2 due, none running;
    * per tenant (1 each): acme and bolt running one each with more due, cyan with room;
    * plain: throttled for ten minutes by a handler.

    Returns the running jobs by type.
    """
    flow.ensure(limits_of(registry))
    running: dict[str, list[ClaimedJob]] = {}
    enqueue(GATED, 5)
    running[GATED] = claim(registry, GATED)
    assert len(running[GATED]) == 2
    enqueue(RATED, 3)
    running[RATED] = claim(registry, RATED)
    assert len(running[RATED]) == 1
    TenantWeight.objects.create(tenant="acme", weight=3)
    enqueue(FAIR, 6, "acme")
    enqueue(FAIR, 2, "bolt")
    enqueue(PER_TENANT, 3, "acme")
    enqueue(PER_TENANT, 2, "bolt")
    running[PER_TENANT] = claim(registry, PER_TENANT)
    assert len(running[PER_TENANT]) == 2
    enqueue(PER_TENANT, 1, "cyan")
    queue.throttle(PLAIN, 600, reason="throttled by job plain-7: 429 Too Many Requests")
    enqueue(PLAIN, 4)
    return running
