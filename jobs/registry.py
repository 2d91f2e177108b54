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
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal

from django.core.exceptions import AppRegistryNotReady, ImproperlyConfigured

from jobs.conf import as_timedelta, jobs_settings
from jobs.context import JobContext
from jobs.errors import Reject, RetryAfter
from jobs.payloads import Payload, payload_problems

logger = logging.getLogger("jobs.registry")

CONCURRENCY_MAX = 100
MAX_ATTEMPTS_MAX = 2_147_483_647  # the column is a PostgreSQL integer

type Classification = Literal["reject", "retry_after", "transient", "permanent"]
type Handler[P: Payload] = Callable[[P, JobContext], Any]


def _seconds(value: Any) -> Any:
    """Normalize a number of seconds to a timedelta; leave anything else for validation."""
    try:
        return as_timedelta(value)
    except (TypeError, ValueError, OverflowError):
        return value


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: a random delay up to ``base * 2**(n-1)``, capped.

    Full jitter spreads the retries of many jobs that failed together (an upstream outage)
    over the whole window instead of bunching them at its edges.
    """

    base: timedelta
    cap: timedelta

    def __post_init__(self) -> None:
        for name in ("base", "cap"):
            value = _seconds(getattr(self, name))
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"Backoff {name} must be a positive duration, got {value!r}")
            object.__setattr__(self, name, value)
        if self.base > self.cap:
            raise ValueError(f"Backoff base ({self.base}) must not exceed its cap ({self.cap})")

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retrying after failed attempt number ``attempt`` (from 1)."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        # Past 2**62 the cap has long won; bounding the exponent avoids float overflow.
        ceiling = min(
            self.cap.total_seconds(), self.base.total_seconds() * 2 ** min(attempt - 1, 62)
        )
        return rand() * ceiling


def default_backoff() -> Backoff:
    """The backoff of policies that do not set one: ``JOBS["BACKOFF_BASE"/"BACKOFF_CAP"]``."""
    return Backoff(jobs_settings.BACKOFF_BASE, jobs_settings.BACKOFF_CAP)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How the worker runs one job type. ``None`` fields take the ``JOBS`` setting at use time.

    ``timeout`` and ``retry_in_process_up_to`` accept seconds as well as a timedelta.
    ``permanent_errors`` lists exception classes that fail a job at once instead of retrying;
    ``classify(exc)`` may decide instead, returning ``"transient"`` or ``"permanent"`` (or
    ``None`` for no opinion).
    """

    concurrency: int = 1
    timeout: timedelta = timedelta(seconds=60)
    max_attempts: int = 5
    backoff: Backoff | None = None
    queue: str | None = None
    priority: int = 0
    retry_in_process_up_to: timedelta | None = None
    permanent_errors: tuple[type[BaseException], ...] = ()
    classify: Callable[[BaseException], str | None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", _seconds(self.timeout))
        if self.retry_in_process_up_to is not None:
            object.__setattr__(
                self, "retry_in_process_up_to", _seconds(self.retry_in_process_up_to)
            )
        errors = self.permanent_errors
        if isinstance(errors, type) or not isinstance(errors, tuple | list | set | frozenset):
            errors = (errors,)  # a single class, or something validate() will report
        object.__setattr__(self, "permanent_errors", tuple(errors))

    def validate(self) -> list[str]:
        """Every problem with this policy, as sentences (empty when it is valid)."""
        from jobs.models import PRIORITY_MAX, PRIORITY_MIN  # needs the app registry
        from jobs.queue.types import validate_key

        problems = []
        if not _whole(self.concurrency, 1, CONCURRENCY_MAX):
            problems.append(_range("concurrency", 1, CONCURRENCY_MAX, self.concurrency))
        if not isinstance(self.timeout, timedelta) or self.timeout <= timedelta(0):
            problems.append(f"timeout must be a positive duration, got {self.timeout!r}")
        if not _whole(self.max_attempts, 1, MAX_ATTEMPTS_MAX):
            problems.append(_range("max_attempts", 1, MAX_ATTEMPTS_MAX, self.max_attempts))
        if self.backoff is not None and not isinstance(self.backoff, Backoff):
            problems.append(f"backoff must be a Backoff or None, got {self.backoff!r}")
        if self.queue is not None:
            try:
                validate_key(self.queue, "queue")
            except ValueError as exc:
                problems.append(str(exc))
        if not _whole(self.priority, PRIORITY_MIN, PRIORITY_MAX):
            problems.append(_range("priority", PRIORITY_MIN, PRIORITY_MAX, self.priority))
        wait = self.retry_in_process_up_to
        if wait is not None and (not isinstance(wait, timedelta) or wait < timedelta(0)):
            problems.append(
                f"retry_in_process_up_to must be zero or a positive duration, got {wait!r}"
            )
        for error in self.permanent_errors:
            if not (isinstance(error, type) and issubclass(error, BaseException)):
                problems.append(f"permanent_errors must hold exception classes, got {error!r}")
        if self.classify is not None and not callable(self.classify):
            problems.append(f"classify must be callable or None, got {self.classify!r}")
        return problems

    def resolved_backoff(self) -> Backoff:
        """This policy's backoff, or the settings' default."""
        return self.backoff or default_backoff()

    def in_process_limit(self) -> timedelta:
        """Retry delays up to this long are waited out in the worker; longer ones requeue."""
        if self.retry_in_process_up_to is None:
            return jobs_settings.RETRY_IN_PROCESS_UP_TO
        return self.retry_in_process_up_to


def classify(policy: Policy, exc: BaseException) -> Classification:
    """How a handler's exception ends its attempt.

    ``Reject`` and ``RetryAfter`` say so themselves; then the policy's ``classify`` hook (a
    hook that fails or answers something else is logged and ignored, so it cannot stall the
    worker); then ``permanent_errors``; anything else is transient and retried.
    """
    if isinstance(exc, Reject):
        return "reject"
    if isinstance(exc, RetryAfter):
        return "retry_after"
    if policy.classify is not None:
        try:
            answer = policy.classify(exc)
        except Exception:
            logger.exception("policy.classify raised; falling back to permanent_errors")
            answer = None
        if answer == "transient":
            return "transient"
        if answer == "permanent":
            return "permanent"
        if answer is not None:
            logger.warning("policy.classify returned %r, not 'transient' or 'permanent'", answer)
    if policy.permanent_errors and isinstance(exc, policy.permanent_errors):
        return "permanent"
    return "transient"


@dataclass(frozen=True)
class JobType:
    """One executable job type: its payload class, its handler and its policy."""

    payload_type: type[Payload]
    handler: Handler[Any]
    policy: Policy = field(default_factory=Policy)

    @property
    def name(self) -> str:
        return self.payload_type.job_name

    @property
    def is_async(self) -> bool:
        """True for ``async def`` handlers, which the worker runs on an event loop."""
        call = getattr(self.handler, "__call__", None)  # noqa: B004 - async callable objects
        return inspect.iscoroutinefunction(self.handler) or inspect.iscoroutinefunction(call)

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
    payload_type: type[P], handler: Handler[P], *, policy: Policy | None = None, **options: Any
) -> JobType:
    """Register ``handler`` for ``payload_type`` with a policy (or the policy's options)."""
    if policy is not None and options:
        raise TypeError("give either policy= or policy options, not both")
    job_type = JobType(payload_type, handler, policy or Policy(**options))
    catalogue.add(job_type)
    return job_type


def job[P: Payload](
    payload_type: type[P], *, policy: Policy | None = None, **options: Any
) -> Callable[[Handler[P]], Handler[P]]:
    """Decorator form of :func:`register`; returns the handler unchanged."""

    def decorator(handler: Handler[P]) -> Handler[P]:
        register(payload_type, handler, policy=policy, **options)
        return handler

    return decorator


def get_registry() -> Registry:
    """The process-wide registry, frozen when the ``jobs`` app became ready."""
    return catalogue.get()


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _range(name: str, low: int, high: int, value: object) -> str:
    return f"{name} must be a whole number from {low} to {high}, got {value!r}"


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
