"""Charge an order exactly once, even when the provider's answer is lost (docs/effects.md)."""

from __future__ import annotations

from datetime import timedelta

import jobs
from jobs import JobContext, Payload, RetryAfter, job
from project.payments import provider


class ChargeOrderV1(Payload, name="payments.charge_order.v1"):
    """Charge ``amount_cents`` for ``order``. ``lose_first_response`` makes the provider's
    first answer get lost (the demo's way to show the retry that reconciles)."""

    order: str
    amount_cents: int
    lose_first_response: bool = False


@job(ChargeOrderV1, timeout=timedelta(seconds=30), max_attempts=5)
def charge_order(payload: ChargeOrderV1, ctx: JobContext) -> provider.Receipt:
    step = jobs.effect(ctx, "charge")
    try:
        # The intent commits before the call and the receipt after it. A retry that finds
        # the intent without a receipt asks the provider (``find``) instead of charging again.
        return step.run(
            lambda key: provider.charge(
                key,
                order=payload.order,
                amount_cents=payload.amount_cents,
                lose_response=payload.lose_first_response and ctx.attempt == 1,
            ),
            reconcile=provider.find,
        )
    except provider.LostResponse as exc:
        raise RetryAfter(1, str(exc)) from exc
