"""A job type bound to a run table, registered process-wide (for the binding tests)."""

from __future__ import annotations

from jobs import JobContext, Payload, Policy, register
from jobs.catalogue.registry import Backoff
from tests.runapp.models import Delivery


class DeliverV1(Payload, name="runapp.deliver.v1"):
    """Deliver the mail of one Delivery row; ``plan`` says what each attempt does."""

    run_id: int
    plan: tuple[str, ...] = ("ok",)
    seconds: float = 0.0


def deliver(payload: DeliverV1, ctx: JobContext) -> None:
    action = payload.plan[min(ctx.attempt, len(payload.plan)) - 1]
    if action == "error":
        raise ConnectionError("smtp down")
    if action == "slow":
        ctx.sleep(payload.seconds)


register(
    DeliverV1,
    deliver,
    policy=Policy(
        run_model=Delivery,
        max_attempts=3,
        backoff=Backoff(base=0.01, cap=0.05),
    ),
)
