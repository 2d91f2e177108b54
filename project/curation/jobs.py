"""The curation job type: one pass over a collection, keeping its run row in step."""

from __future__ import annotations

from datetime import timedelta

from django.db.models.functions import Now

from jobs import JobContext, Payload, Reject, job
from jobs.runs import ErrorCode
from project.curation import passes
from project.curation.models import Document


class CuratePassV1(Payload, name="curation.pass.v1"):
    run_id: int  # the run it was enqueued for; a replayed job works on a newer one (passes.begin)


@job(CuratePassV1, concurrency=2, timeout=timedelta(seconds=60), max_attempts=1)
def curate(payload: CuratePassV1, ctx: JobContext) -> None:
    """Curate every document of the collection; a document without a body fails the pass."""
    run = passes.begin(payload.run_id, job=ctx.id)
    if run is None:
        return  # nothing to run: a repeat delivery of a finished pass is a no-op
    stats = {"checked": 0, "curated": 0}
    try:
        for document in Document.objects.filter(collection=run.collection).order_by("pk"):
            ctx.raise_if_cancelled()
            stats["checked"] += 1
            if not document.body.strip():
                stats["failed_at"] = document.pk
                raise Reject(f"document {document.pk} ({document.title!r}) has no body")
            Document.objects.filter(pk=document.pk).update(curated_at=Now())
            stats["curated"] += 1
            passes.beat(run.pk, stats)
    except Reject as exc:
        passes.fail(run.pk, code=ErrorCode.REJECTED, detail=str(exc), stats=stats)
        raise
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"
        passes.fail(run.pk, code=ErrorCode.HANDLER_ERROR, detail=detail, stats=stats)
        raise
    passes.succeed(run.pk, stats)
