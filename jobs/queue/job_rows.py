"""The row a new job becomes: each field of a :class:`~jobs.queue.NewJob` checked, the ``JOBS``
defaults filled in, the payload encoded. Enqueue (:mod:`jobs.queue.enqueue`) and a batch's
successor template (:mod:`jobs.queue.batches`) build their rows here, so both refuse the same
jobs with the same words (:class:`~jobs.queue.InvalidJob`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.utils import timezone

from jobs.core.conf import jobs_settings
from jobs.core.limits import MAX_ATTEMPTS_MAX, PRIORITY_MAX, PRIORITY_MIN, validate_key
from jobs.models import new_job_id
from jobs.queue import _db, dependencies, text
from jobs.queue.types import InvalidJob, NewJob

#: The furthest ahead ``delay`` may put a job; ``run_after`` is bounded by datetime itself.
DELAY_MAX = timedelta(days=100 * 365)


def validated_row(job: NewJob) -> dict[str, Any]:
    """The column values enqueue would insert for ``job`` (raises :class:`InvalidJob`)."""
    return job_row(job, None)


def row_key(row: dict[str, Any]) -> tuple[str, str]:
    """A row's key: (tenant, job_id)."""
    return (row["tenant"], row["job_id"])


# Names, tenants and queues repeat from job to job: each is checked once (a refused one
# raises every time, as exceptions are not kept).
_name_problem = lru_cache(maxsize=1024)(text.problem)
_valid_key = lru_cache(maxsize=1024)(validate_key)


def _checked_key(value: object, what: str) -> str:
    return _valid_key(value, what) if isinstance(value, str) else validate_key(value, what)


def job_defaults() -> tuple[str, str, int]:
    """The ``JOBS`` defaults a job without its own takes: tenant, queue and max_attempts
    (read once a batch, not once a job)."""
    return (
        jobs_settings.DEFAULT_TENANT,
        jobs_settings.DEFAULT_QUEUE,
        jobs_settings.DEFAULT_MAX_ATTEMPTS,
    )


def job_row(
    job: NewJob,
    index: int | None,
    defaults: tuple[str, str, int] | None = None,
    new_id: Callable[[], str] = new_job_id,
) -> dict[str, Any]:
    """Validate one job and turn it into column values (raises InvalidJob). A keyless job
    takes ``new_id()``: a batch's ids are drawn together (:func:`jobs.models.new_job_ids`)."""
    default_tenant, default_queue, default_max_attempts = defaults or job_defaults()
    if not isinstance(job, NewJob):
        raise InvalidJob(f"expected a NewJob, got {type(job).__name__}", index=index)
    if not isinstance(job.name, str) or not job.name or len(job.name) > 200:
        raise InvalidJob(
            f"name must be a non-empty string of at most 200 characters, got {job.name!r}",
            index=index,
        )
    if job.job_id is None:
        job_id = new_id()  # hex digits: nothing to check
    else:
        job_id = job.job_id
        if not isinstance(job_id, str) or not job_id or len(job_id) > 255:
            raise InvalidJob(
                f"job_id must be a non-empty string of at most 255 characters, got {job_id!r}",
                index=index,
            )
        bad = text.problem(job_id)
        if bad:
            raise InvalidJob(f"job_id {bad}: {job_id!r}", index=index)
    bad = _name_problem(job.name)
    if bad:
        raise InvalidJob(f"name {bad}: {job.name!r}", index=index)
    try:
        tenant = _checked_key(job.tenant or default_tenant, "tenant")
        queue = _checked_key(job.queue or default_queue, "queue")
    except ValueError as exc:
        raise InvalidJob(str(exc), index=index) from None
    if (
        isinstance(job.priority, bool)
        or not isinstance(job.priority, int)
        or not PRIORITY_MIN <= job.priority <= PRIORITY_MAX
    ):
        raise InvalidJob(
            f"priority must be a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}, "
            f"got {job.priority!r}",
            index=index,
        )
    max_attempts = default_max_attempts if job.max_attempts is None else job.max_attempts
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS_MAX
    ):
        raise InvalidJob(
            f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS_MAX:,}, "
            f"got {max_attempts!r}",
            index=index,
        )
    if job.run_after is not None and job.delay is not None:
        raise InvalidJob("give run_after or delay, not both", index=index)
    if job.run_after is not None and (
        not isinstance(job.run_after, datetime) or timezone.is_naive(job.run_after)
    ):
        raise InvalidJob(f"run_after must be an aware datetime, got {job.run_after!r}", index=index)
    if job.delay is not None and (
        not isinstance(job.delay, timedelta) or abs(job.delay) > DELAY_MAX
    ):
        raise InvalidJob(
            f"delay must be a timedelta of at most {DELAY_MAX.days} days, got {job.delay!r}",
            index=index,
        )
    delay = 0.0 if job.delay is None else _db.seconds(job.delay)
    # Most jobs wait for nothing: the empty tuple NewJob gives needs no checking.
    after = () if type(job.after) is tuple and not job.after else dependencies.validate(job, index)
    if job.batch_id is not None and (
        isinstance(job.batch_id, bool) or not isinstance(job.batch_id, int)
    ):
        raise InvalidJob(f"batch_id must be a batch's id, got {job.batch_id!r}", index=index)
    if not isinstance(job.payload, dict):
        raise InvalidJob(
            f"payload must be a dict (a JSON object), got {type(job.payload).__name__}", index=index
        )
    try:
        payload = text.dumps(job.payload)
    except ValueError as exc:
        raise InvalidJob(f"payload is not JSON-serializable: {exc}", index=index) from None
    return {
        "job_id": job_id,
        "keyed": job.job_id is not None,
        "name": job.name,
        "payload": payload,
        "tenant": tenant,
        "queue": queue,
        "priority": job.priority,
        "max_attempts": max_attempts,
        "run_after": job.run_after,
        "delay": delay,
        "batch_id": job.batch_id,
        "waiting_on": 0,
        "after": after,
        "on_dependency_failure": job.on_dependency_failure,
    }
