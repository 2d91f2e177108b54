"""The harvest job type: fetch one item; an item that cannot be fetched goes to the DLQ."""

from __future__ import annotations

from datetime import timedelta

from jobs import Backoff, JobContext, Payload, Reject, job
from jobs.runs import ErrorCode
from project.harvester import dead_letters, sources
from project.harvester.models import Item


class HarvestItemV1(Payload, name="harvester.harvest.v1"):
    item_id: int
    dead_letter_id: int | None = None  # set when an operator re-picks a dead letter


@job(
    HarvestItemV1,
    concurrency=4,
    timeout=timedelta(seconds=30),
    max_attempts=3,
    backoff=Backoff(timedelta(seconds=1), timedelta(seconds=4)),
)
def harvest(payload: HarvestItemV1, ctx: JobContext) -> None:
    if payload.dead_letter_id is not None:
        dead_letters.start(payload.dead_letter_id)
    item = Item.objects.filter(pk=payload.item_id).first()
    if item is None:
        raise Reject(f"item {payload.item_id} does not exist")
    try:
        page = sources.fetch(item.url)
    except sources.SourceError as exc:
        dead_letters.dead_letter(item.pk, code=ErrorCode.REJECTED, detail=str(exc))
        raise Reject(str(exc)) from exc
    except Exception as exc:
        if ctx.final_attempt:
            detail = f"{type(exc).__name__}: {exc}"
            dead_letters.dead_letter(item.pk, code=ErrorCode.HANDLER_ERROR, detail=detail)
        raise
    dead_letters.harvested(item.pk, page)
