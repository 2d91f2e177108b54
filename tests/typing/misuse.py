"""Wrong uses of the public API that a user's type checker must refuse.

Never imported: tests/unit/test_typing.py runs mypy on it and expects exactly the errors
marked ``# E: <code> [text]`` on their lines (with that text in the message), no others.
"""

from __future__ import annotations

from datetime import timedelta

from jobs import JobContext, JobSpec, Payload, Policy, RetryAfter, enqueue, enqueue_many, job


class ResizeImageV1(Payload, name="images.resize.v1"):
    image_id: int


class PurgeCacheV1(Payload, name="images.purge_cache.v1"):
    prefix: str


@job(ResizeImageV1, max_attempts="5")  # E: arg-type "max_attempts" to "job" has incompatible type
def resize(payload: ResizeImageV1, ctx: JobContext) -> None: ...


@job(ResizeImageV1)  # E: arg-type expected "Callable[[ResizeImageV1, JobContext], Any]"
def purge(payload: PurgeCacheV1, ctx: JobContext) -> None: ...


@job(ResizeImageV1, retries=3)  # E: call-arg "retries"
def retry(payload: ResizeImageV1, ctx: JobContext) -> None: ...


def enqueue_wrongly() -> None:
    ResizeImageV1(image_id="7")  # E: arg-type "image_id"
    ResizeImageV1(7)  # E: call-arg positional
    ResizeImageV1(image_id=7).image_id = 8  # E: misc read-only
    enqueue({"image_id": 7})  # E: arg-type expected "Payload"
    enqueue(ResizeImageV1(image_id=7), priority="high")  # E: arg-type "priority"
    enqueue_many([JobSpec(payload=ResizeImageV1(image_id=7), delay="soon")])  # E: arg-type "delay"
    Policy(timeout="20s")  # E: arg-type "timeout"
    RetryAfter("30")  # E: arg-type "RetryAfter"
    enqueue(PurgeCacheV1(prefix="a/"), run_after=timedelta(minutes=1))  # E: arg-type "run_after"
