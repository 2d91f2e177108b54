"""A user's app as their type checker sees it: mypy must pass this module without an error.

Never imported (its job types would join the registry): tests/unit/test_typing.py runs mypy
on it. Each ``assert_type`` states a type the public API promises to a user.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, assert_type, reveal_type

from jobs import (
    Backoff,
    Cancelled,
    InvalidPayload,
    JobContext,
    JobSpec,
    Payload,
    Policy,
    Reject,
    RetryAfter,
    enqueue,
    enqueue_many,
    job,
    register,
)
from jobs.catalogue.registry import JobType
from jobs.queue import Enqueued


class ResizeImageV1(Payload, name="images.resize.v1"):
    image_id: int
    width: int = 800
    formats: tuple[str, ...] = ("webp",)

    def validate(self) -> None:
        if self.width <= 0:
            raise ValueError("width must be positive")


class PurgeCacheV1(Payload, name="images.purge_cache.v1"):
    prefix: str


@job(
    ResizeImageV1,
    concurrency=2,
    timeout=20,  # seconds, or a timedelta
    max_attempts=5,
    backoff=Backoff(base=1, cap=timedelta(minutes=5)),
    permanent_errors=(KeyError,),
    queue="images",
)
def resize_image(payload: ResizeImageV1, ctx: JobContext) -> None:
    assert_type(payload.image_id, int)
    assert_type(payload.formats, tuple[str, ...])
    assert_type(ctx.attempt, int)
    assert_type(ctx.final_attempt, bool)
    assert_type(ctx.deadline, float)
    assert_type(ctx.sleep(0.5), bool)
    ctx.raise_if_cancelled()
    ctx.logger.info("resizing image %s", payload.image_id)
    if payload.image_id < 0:
        raise Reject("no such image")
    raise RetryAfter(timedelta(seconds=30), "the image store is busy")


# The decorator hands the handler back, typed by its payload class.
assert_type(resize_image, Callable[[ResizeImageV1, JobContext], Any])
reveal_type(resize_image)


async def purge_cache(payload: PurgeCacheV1, ctx: JobContext) -> None:
    assert_type(payload.prefix, str)


purge_type = register(PurgeCacheV1, purge_cache, policy=Policy(timeout=5, max_attempts=2))
assert_type(purge_type, JobType)
assert_type(purge_type.policy.timeout, timedelta)  # seconds are read back as a timedelta
assert_type(purge_type.policy.max_attempts, int)


def resize_all(image_ids: list[int]) -> list[Enqueued]:
    """Enqueue one resize per image, two ways, and read what enqueue returned."""
    payload = ResizeImageV1(image_id=image_ids[0], width=400)
    assert_type(payload, ResizeImageV1)
    assert_type(ResizeImageV1.job_name, str)
    assert_type(payload.to_json(), dict[str, Any])
    assert_type(ResizeImageV1.from_json('{"image_id": 1}'), ResizeImageV1)

    first = enqueue(payload, job_id=f"resize-{payload.image_id}", delay=10, priority=5)
    assert_type(first, Enqueued)
    assert_type(first.id, int)
    assert_type(first.created, bool)

    specs = [
        JobSpec(payload=ResizeImageV1(image_id=i), delay=timedelta(minutes=1)) for i in image_ids
    ]
    many = enqueue_many([*specs, PurgeCacheV1(prefix="thumbs/")], tenant="acme", queue="images")
    assert_type(many, list[Enqueued])
    return [first, *many]


def describe(exc: Exception) -> str:
    """The public exceptions carry typed details."""
    if isinstance(exc, RetryAfter):
        assert_type(exc.delay, float)
        return f"retry in {exc.delay}s"
    if isinstance(exc, InvalidPayload):
        assert_type(exc.path, str)
        return f"{exc.path}: {exc.reason}"
    if isinstance(exc, Cancelled | Reject):
        return str(exc)
    return repr(exc)
