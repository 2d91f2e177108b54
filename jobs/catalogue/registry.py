"""The catalogue of job types this process can run: payload type, handler and policy.

Apps declare job types in ``<app>/jobs.py`` (imported at start-up, like ``admin.py``)::

    @job(SendEmailV1, concurrency=2, timeout=20, max_attempts=5)
    def send_email(payload: SendEmailV1, ctx: JobContext) -> None: ...

Registrations collect in a pending list until ``JobsConfig.ready()`` freezes them into one
immutable :class:`Registry`, refusing the whole catalogue (with every problem listed) if any
entry is invalid. The worker claims only the names in it, so a job type that is not
registered stays queued and untouched. Nothing here does I/O.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Unpack

from django.core.exceptions import AppRegistryNotReady, ImproperlyConfigured

from jobs.catalogue.payloads import Payload, payload_problems

# Re-exported: job types are declared with these names from this module too.
from jobs.catalogue.policy import CONCURRENCY_MAX as CONCURRENCY_MAX
from jobs.catalogue.policy import Backoff as Backoff
from jobs.catalogue.policy import Classification as Classification
from jobs.catalogue.policy import Policy as Policy
from jobs.catalogue.policy import PolicyOptions as PolicyOptions
from jobs.catalogue.policy import Rate as Rate
from jobs.catalogue.policy import classify as classify
from jobs.catalogue.policy import default_backoff as default_backoff
from jobs.core.conf import as_timedelta
from jobs.core.context import JobContext
from jobs.core.limits import MAX_ATTEMPTS_MAX as MAX_ATTEMPTS_MAX

logger = logging.getLogger("jobs.registry")

type Handler[P: Payload] = Callable[[P, JobContext], Any]


@dataclass(frozen=True)
class JobType:
    """One executable job type: its payload class, its handler and its policy."""

    payload_type: type[Payload]
    handler: Handler[Any]
    policy: Policy = field(default_factory=Policy)

    @property
    def name(self) -> str:
        return self.payload_type.job_name

    @cached_property
    def is_async(self) -> bool:
        """True for ``async def`` handlers, which the worker runs on an event loop."""
        call = getattr(self.handler, "__call__", None)  # noqa: B004 - async callable objects
        return inspect.iscoroutinefunction(self.handler) or inspect.iscoroutinefunction(call)

    @cached_property
    def timeout_seconds(self) -> float:
        """The policy's timeout in seconds (every claimed job's context carries it)."""
        return as_timedelta(self.policy.timeout).total_seconds()

    def decode(self, raw: object) -> Payload:
        """The stored payload as a typed value; raises InvalidPayload if it does not fit."""
        return self.payload_type.from_json(raw)

    def problems(self) -> list[str]:
        """Everything wrong with this registration, each line naming it."""
        name = getattr(self.payload_type, "job_name", None) or _qualname(self.payload_type)
        label = f"{name} ({_qualname(self.handler)})"
        problems = list(payload_problems(self.payload_type))
        if not callable(self.handler):
            problems.append(f"handler {self.handler!r} is not callable")
        elif not _accepts_two_arguments(self.handler):
            problems.append("handler must accept two positional arguments (payload, ctx)")
        if isinstance(self.policy, Policy):
            problems.extend(self.policy.validate())
            fields = getattr(self.payload_type, "__dataclass_fields__", {})
            if self.policy.run_model is not None and self.policy.run_field not in fields:
                problems.append(
                    f"run_field {self.policy.run_field!r} is not a field of the payload, so "
                    "the worker cannot find the run row"
                )
        else:
            problems.append(f"policy must be a jobs.Policy, got {self.policy!r}")
        return [f"{label}: {problem}" for problem in problems]


class Registry:
    """An immutable catalogue of job types, keyed by name; refuses any invalid entry."""

    __slots__ = ("_types",)

    def __init__(self, job_types: Iterable[JobType] = ()) -> None:
        job_types = list(job_types)
        problems: list[str] = []
        by_name: dict[str, JobType] = {}
        for index, job_type in enumerate(job_types):
            if not isinstance(job_type, JobType):
                problems.append(f"entry #{index} is not a JobType: {job_type!r}")
                continue
            problems.extend(job_type.problems())
            name = getattr(job_type.payload_type, "job_name", None)
            if name is None:
                continue
            first = by_name.get(name)
            if first is None:
                by_name[name] = job_type
            elif first.payload_type is job_type.payload_type:
                problems.append(
                    f"{name} is registered twice: {_qualname(first.handler)} and "
                    f"{_qualname(job_type.handler)}"
                )
            else:
                problems.append(
                    f"{name} is claimed by two payload classes: "
                    f"{_qualname(first.payload_type)} and {_qualname(job_type.payload_type)}"
                )
        if problems:
            raise ImproperlyConfigured(
                "Invalid job types:\n" + "\n".join(f"  - {problem}" for problem in problems)
            )
        self._types: Mapping[str, JobType] = MappingProxyType(dict(sorted(by_name.items())))

    def names(self) -> tuple[str, ...]:
        return tuple(self._types)

    def get(self, name: str) -> JobType | None:
        return self._types.get(name)

    def max_attempts(self) -> dict[str, int]:
        """Each type's attempt limit, for the queue's claim and exhaustion passes."""
        return {name: job_type.policy.max_attempts for name, job_type in self._types.items()}

    def __getitem__(self, name: str) -> JobType:
        try:
            return self._types[name]
        except KeyError:
            raise KeyError(f"no job type named {name!r} is registered") from None

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def __iter__(self) -> Iterator[JobType]:
        return iter(self._types.values())

    def __len__(self) -> int:
        return len(self._types)

    def __repr__(self) -> str:
        return f"<Registry {list(self._types)}>"


class Catalogue:
    """Registrations made at import time, frozen once into a :class:`Registry`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[JobType] = []
        self._registry: Registry | None = None

    def add(self, job_type: JobType) -> None:
        with self._lock:
            if self._registry is not None:
                name = getattr(job_type.payload_type, "job_name", job_type.payload_type)
                raise ImproperlyConfigured(
                    f"job type {name} was registered after start-up; register job "
                    f"types in <app>/jobs.py, which is imported at start-up"
                )
            self._pending.append(job_type)

    def freeze(self) -> Registry:
        """Build the registry from everything registered so far (once; later calls return it)."""
        with self._lock:
            if self._registry is None:
                self._registry = Registry(self._pending)
                self._pending = []
            return self._registry

    def get(self) -> Registry:
        if self._registry is None:
            raise AppRegistryNotReady(
                "the job registry is built when Django starts (django.setup()); it is not ready"
            )
        return self._registry

    @property
    def frozen(self) -> bool:
        return self._registry is not None


catalogue = Catalogue()


def register[P: Payload](
    payload_type: type[P],
    handler: Handler[P],
    *,
    policy: Policy | None = None,
    **options: Unpack[PolicyOptions],
) -> JobType:
    """Register ``handler`` for ``payload_type`` with a policy (or the policy's options)."""
    if policy is not None and options:
        raise TypeError("give either policy= or policy options, not both")
    job_type = JobType(payload_type, handler, policy or Policy(**options))
    catalogue.add(job_type)
    return job_type


def job[P: Payload](
    payload_type: type[P], *, policy: Policy | None = None, **options: Unpack[PolicyOptions]
) -> Callable[[Handler[P]], Handler[P]]:
    """Decorator form of :func:`register`; returns the handler unchanged."""

    def decorator(handler: Handler[P]) -> Handler[P]:
        register(payload_type, handler, policy=policy, **options)
        return handler

    return decorator


def get_registry() -> Registry:
    """The process-wide registry, frozen when the ``jobs`` app became ready."""
    return catalogue.get()


def _qualname(obj: object) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or repr(obj)
    return f"{module}.{name}" if module else name


def _accepts_two_arguments(handler: Callable[..., Any]) -> bool:
    try:
        inspect.signature(handler).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (some builtins): give it the benefit
        return True
    return True
