"""Enqueue typed payloads: the producer side of a job type's contract.

Producers hand over payload values, never a name and a dict: the name comes from the payload's
class, the stored JSON from :meth:`Payload.to_json`, and each payload is decoded back and
validated before anything is written, so a worker never meets a payload its own type would
refuse. Defaults for queue, priority and attempts come from the type's registered policy when
this process registers the type, else from the ``JOBS`` settings.

Call these inside the ``transaction.atomic()`` block of the business write the jobs follow:
the jobs then commit or roll back with it, and workers see them only after commit.

This module imports the queue (and so the models) only when called, so it stays importable
before Django's app registry is ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from jobs.catalogue import routing as databases
from jobs.catalogue.payloads import InvalidPayload, Payload, checked_json
from jobs.catalogue.registry import Policy, catalogue
from jobs.core.conf import as_timedelta
from jobs.core.frozen import direct_init

if TYPE_CHECKING:
    from jobs.queue import Enqueued, NewJob


@direct_init
@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """A payload with its own enqueue options, for batches whose jobs differ.

    ``None`` means "not set here": :func:`enqueue_many`'s shared option, then the type's
    policy, then the ``JOBS`` default. Giving ``run_after`` or ``delay`` here replaces the
    batch's timing for this job.
    """

    payload: Payload
    job_id: str | None = None
    tenant: str | None = None
    queue: str | None = None
    priority: int | None = None
    run_after: datetime | None = None
    delay: timedelta | float | None = None
    max_attempts: int | None = None
    after: Sequence[Enqueued | int | str] | None = None
    on_dependency_failure: str | None = None


def enqueue(
    payload: Payload,
    *,
    job_id: str | None = None,
    tenant: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    run_after: datetime | None = None,
    delay: timedelta | float | None = None,
    max_attempts: int | None = None,
    after: Sequence[Enqueued | int | str] | None = None,
    on_dependency_failure: str | None = None,
    using: str | None = None,
) -> Enqueued:
    """Enqueue one typed job, or return the job already holding its ``(tenant, job_id)``.

    ``after`` lists jobs (enqueue results, row ids, or job_ids you chose, of the same tenant;
    a job enqueued without one is named by its row id) this one waits for: it is claimed
    only once all of them have succeeded. If one fails for good or is cancelled, this job is
    cancelled (``on_dependency_failure="cancel"``, the default) or
    failed (``"fail"``). See ``docs/workflows.md``. ``using`` names the database alias; by
    default the job goes to its type's (``@job(..., database=...)``, else
    ``JOBS["DATABASE"]``), see ``docs/databases.md``.
    """
    spec = JobSpec(
        payload=payload,
        job_id=job_id,
        tenant=tenant,
        queue=queue,
        priority=priority,
        run_after=run_after,
        delay=delay,
        max_attempts=max_attempts,
        after=after,
        on_dependency_failure=on_dependency_failure,
    )
    return enqueue_many([spec], using=using)[0]


def enqueue_many(
    jobs: Iterable[Payload | JobSpec],
    *,
    tenant: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    run_after: datetime | None = None,
    delay: timedelta | float | None = None,
    max_attempts: int | None = None,
    after: Sequence[Enqueued | int | str] | None = None,
    on_dependency_failure: str | None = None,
    using: str | None = None,
) -> list[Enqueued]:
    """Enqueue a batch of payloads (or :class:`JobSpec` values) atomically, in input order.

    The keyword options apply to every job that does not set its own. The whole batch is
    encoded and validated first: one invalid payload raises ``jobs.queue.InvalidJob`` naming
    its index and field, and nothing is inserted.
    """
    from jobs import queue as jobs_queue

    shared = {
        "tenant": tenant,
        "queue": queue,
        "priority": priority,
        "run_after": run_after,
        "delay": delay,
        "max_attempts": max_attempts,
        "after": after,
        "on_dependency_failure": on_dependency_failure,
    }
    built = new_jobs(jobs, shared, using=using)
    return jobs_queue.enqueue_many(built, using=routed(built, using))


def routed(jobs: Sequence[NewJob], using: str | None) -> str:
    """The one alias ``jobs`` go to (their types' alias, or ``using`` when their types allow
    it); raises ``InvalidJob`` for a batch that would span databases. Resolved here, once, so
    the queue below is told where to write and never asks the catalogue."""
    return databases.route([(index, job.name) for index, job in enumerate(jobs)], using)


def new_jobs(
    jobs: Iterable[Payload | JobSpec], shared: dict[str, Any], *, using: str | None = None
) -> list[NewJob]:
    """The queue's jobs for typed payloads, with ``shared`` as every job's default options.

    ``using`` is the alias they are enqueued with (None: their types'), against which the
    enqueue results they wait for (``after``) are checked.
    """
    from jobs.queue import NewJob  # once a batch: an import costs a job's validation

    shared = {key: shared.get(key) for key in _SHARED}
    items = list(jobs)
    policies: dict[type[Payload], Policy | None] = {}  # one registry lookup a type, not a job
    plain: dict[type[Payload], dict[str, Any]] = {}
    built = [
        _new_job(item, index, shared, policies, NewJob, plain) for index, item in enumerate(items)
    ]
    if any(job.after for job in built):
        _waits_in_one_database(items, built, shared["after"], using)
    return built


def _waits_in_one_database(
    items: list[Any], built: list[NewJob], shared_after: Any, using: str | None
) -> None:
    """A job waits only for jobs of its own database: row ids are counted per database, so
    an id from another one names an unrelated job here (or none)."""
    from jobs.queue import Enqueued, InvalidJob

    found = []
    for index, item in enumerate(items):
        own = item.after if isinstance(item, JobSpec) else None
        for upstream in _first(own, shared_after) or ():
            if isinstance(upstream, Enqueued):
                found.append((index, upstream))
    if not found:
        return
    target = routed(built, using)
    for index, upstream in found:
        if upstream.using != target:
            raise InvalidJob(
                f"after: job {upstream.id} ({upstream.name}) is in database "
                f"{upstream.using!r}, and this job goes to {target!r}: a job waits only for "
                "jobs of its own database",
                index=index,
            )


# The options enqueue_many applies to every job that does not set its own.
_SHARED = (
    "tenant",
    "queue",
    "priority",
    "run_after",
    "delay",
    "max_attempts",
    "after",
    "on_dependency_failure",
)


def _new_job(
    item: object,
    index: int,
    shared: dict[str, Any],
    policies: dict[type[Payload], Policy | None],
    new_job: type[NewJob],
    plain: dict[type[Payload], dict[str, Any]],
) -> NewJob:
    # A plain payload takes every option from the batch: no JobSpec is made for it, and its
    # options are worked out once for its type (``plain``), not once a job.
    spec = None if isinstance(item, Payload) else item
    if spec is not None and (
        not isinstance(spec, JobSpec) or not isinstance(spec.payload, Payload)
    ):
        found = spec.payload if isinstance(spec, JobSpec) else spec
        raise _invalid(
            f"expected a Payload or JobSpec, got {type(found).__name__}; "
            f"define the job's payload as a jobs.Payload subclass",
            index,
        )
    payload: Payload = item if spec is None else spec.payload  # type: ignore[assignment]
    payload_type = type(payload)
    name = payload_type.job_name
    try:
        data = checked_json(payload)  # the worker's decode: types, then validate()
    except InvalidPayload as exc:
        raise _invalid(f"{name}: invalid payload: {exc}", index) from None
    if spec is None:
        options = plain.get(payload_type)
        if options is None:
            options = plain[payload_type] = _options(None, payload_type, index, shared, policies)
        return new_job(name=name, payload=data, **options)
    return new_job(name=name, payload=data, **_options(spec, payload_type, index, shared, policies))


def _options(
    spec: JobSpec | None,
    payload_type: type[Payload],
    index: int,
    shared: dict[str, Any],
    policies: dict[type[Payload], Policy | None],
) -> dict[str, Any]:
    """A job's NewJob options but its name and payload: its own, else the batch's, else its
    type's policy's (None: the ``JOBS`` default)."""
    name = payload_type.job_name
    if payload_type in policies:
        policy = policies[payload_type]
    else:
        policy = policies[payload_type] = _policy(payload_type, index)
    if spec is not None and (spec.run_after is not None or spec.delay is not None):
        run_after, delay = spec.run_after, spec.delay
    else:
        run_after, delay = shared["run_after"], shared["delay"]
    if delay is not None:
        try:
            delay = as_timedelta(delay)
        except (TypeError, ValueError, OverflowError) as exc:
            raise _invalid(f"delay: {exc}", index) from None
    after = _own(spec, "after", shared)
    if after is not None and not isinstance(after, str | bytes):
        try:
            after = tuple(getattr(item, "id", item) for item in after)
        except TypeError:
            raise _invalid(
                f"after must be a list of jobs, got {type(after).__name__}", index
            ) from None
    if after and policy is not None and policy.run_model is not None:
        # A waiting job the trigger ends would leave its bound run row queued for ever.
        raise _invalid(
            f"{name}: a job type bound to a run table (run_model) cannot wait for other jobs",
            index,
        )
    priority = _own(spec, "priority", shared)
    if priority is None:
        priority = policy.priority if policy else 0
    queue = _own(spec, "queue", shared)
    if queue is None and policy is not None:
        queue = policy.queue
    max_attempts = _own(spec, "max_attempts", shared)
    if max_attempts is None and policy is not None:
        max_attempts = policy.max_attempts
    return {
        "job_id": None if spec is None else spec.job_id,
        "tenant": _own(spec, "tenant", shared),
        "queue": queue,
        "priority": priority,
        "run_after": run_after,
        "delay": delay,
        "max_attempts": max_attempts,
        "after": () if after is None else after,  # validated by the queue
        "on_dependency_failure": _own(spec, "on_dependency_failure", shared) or "cancel",
    }


def _invalid(message: str, index: int) -> Exception:
    """The queue's InvalidJob (imported only on this path: an import costs a job's checks)."""
    from jobs.queue import InvalidJob

    return InvalidJob(message, index=index)


def _own(spec: JobSpec | None, option: str, shared: dict[str, Any]) -> Any:
    """A job's own value of ``option``, else the batch's (None: neither is set)."""
    if spec is not None and (value := getattr(spec, option)) is not None:
        return value
    return shared[option]


def _policy(payload_type: type[Payload], index: int) -> Policy | None:
    """The registered type's policy, if this process registers the payload's name."""
    if not catalogue.frozen:
        return None
    job_type = catalogue.get().get(payload_type.job_name)
    if job_type is None:
        return None
    if job_type.payload_type is not payload_type:
        from jobs.queue import InvalidJob

        raise InvalidJob(
            f"{payload_type.__module__}.{payload_type.__qualname__} claims the name "
            f"{payload_type.job_name}, which is registered for "
            f"{job_type.payload_type.__module__}.{job_type.payload_type.__qualname__}",
            index=index,
        )
    return job_type.policy


def _first[T](*values: T | None) -> T | None:
    return next((value for value in values if value is not None), None)
