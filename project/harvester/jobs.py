"""The harvest job type: fetch one item; an item that cannot be fetched goes to the DLQ."""

from __future__ import annotations

from datetime import timedelta

from jobs import Backoff, JobContext, Payload, Reject, job
from jobs.runs import ErrorCode
from project.harvester import dead_letters, sources
from project.harvester.models import Item


class HarvestItemV1(Payload, name="harvester.harvest.v1"):
    item_id: int
    # Set on the new job of a re-picked dead letter whose failed job was gone. For the record
    # only: a harvest works on its item's open dead letter, whichever job it is.
    dead_letter_id: int | None = None


@job(
    HarvestItemV1,
    concurrency=4,
    timeout=timedelta(seconds=30),
    max_attempts=3,
    backoff=Backoff(timedelta(seconds=1), timedelta(seconds=4)),
)
def harvest(payload: HarvestItemV1, ctx: JobContext) -> None:
    item = Item.objects.filter(pk=payload.item_id).first()
    if item is None:
        raise Reject(f"item {payload.item_id} does not exist")
    dead_letters.start(item.pk)
    try:
        page = sources.fetch(item.url)
    except sources.SourceError as exc:
        dead_letters.dead_letter(item.pk, code=ErrorCode.REJECTED, detail=str(exc), job=ctx.id)
        raise Reject(str(exc)) from exc
    except Exception as exc:
        if ctx.final_attempt:
            detail = f"{type(exc).__name__}: {exc}"
            dead_letters.dead_letter(
                item.pk, code=ErrorCode.HANDLER_ERROR, detail=detail, job=ctx.id
            )
        raise
    dead_letters.harvested(item.pk, page)
