"""The mail job type: deliver one message, keeping its delivery row in step."""

from __future__ import annotations

from datetime import timedelta

from jobs import Backoff, JobContext, Payload, Reject, job
from jobs.runs import ErrorCode
from project.mail import deliveries, transport


class DeliverMailV1(Payload, name="mail.deliver.v1"):
    delivery_id: int


@job(
    DeliverMailV1,
    concurrency=4,
    timeout=timedelta(seconds=30),
    max_attempts=3,
    backoff=Backoff(timedelta(seconds=1), timedelta(seconds=4)),
)
def deliver(payload: DeliverMailV1, ctx: JobContext) -> None:
    delivery = deliveries.start(payload.delivery_id, attempt=ctx.attempt)
    if delivery is None:
        return  # delivered already, or gone: a repeat delivery of the job is a no-op
    try:
        transport.send(delivery.to, delivery.subject, delivery.body)
    except transport.Undeliverable as exc:
        deliveries.not_delivered(delivery.pk, code=ErrorCode.REJECTED, detail=str(exc))
        raise Reject(str(exc)) from exc
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"
        if ctx.final_attempt:
            deliveries.not_delivered(delivery.pk, code=ErrorCode.HANDLER_ERROR, detail=detail)
        else:
            deliveries.retrying(delivery.pk, code=ErrorCode.HANDLER_ERROR, detail=detail)
        raise
    deliveries.delivered(delivery.pk)
