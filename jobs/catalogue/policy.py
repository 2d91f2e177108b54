"""Per-type execution policy: concurrency, timeout, attempts, backoff, error classes and flow.

A policy says how the worker runs one job type; ``None`` fields fall back to the ``JOBS``
settings when used, so changing a setting changes every type that did not choose otherwise.
Nothing here does I/O.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from jobs.core.conf import as_timedelta, jobs_settings
from jobs.core.limits import MAX_ATTEMPTS_MAX, PRIORITY_MAX, PRIORITY_MIN, validate_key
from jobs.errors import Reject, RetryAfter

if TYPE_CHECKING:
    from jobs.runs import RunContract

logger = logging.getLogger("jobs.registry")

CONCURRENCY_MAX = 100
# Limits shared by the fleet are not bounded by one process's slots.
GLOBAL_CONCURRENCY_MAX = 1_000_000
RATE_COUNT_MAX = 1_000_000_000

type Classification = Literal["reject", "retry_after", "transient", "permanent"]


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

    if TYPE_CHECKING:
        # __post_init__ turns seconds into a timedelta, so the constructor takes either.
        def __init__(self, base: timedelta | float, cap: timedelta | float) -> None: ...

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
        ceiling: float = min(
            self.cap.total_seconds(), self.base.total_seconds() * 2 ** min(attempt - 1, 62)
        )
        return rand() * ceiling


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts per ``per`` (seconds or a timedelta), shared by every worker.

    A token bucket in PostgreSQL: it refills at ``count / per`` tokens a second up to
    ``burst`` tokens, and every start takes one. So starts are spread evenly over the period
    instead of ``count`` at once at each period's start; a larger ``burst`` lets that many
    start together after a quiet spell. The default burst is 100 ms worth of starts (at least
    1), which lets workers that claim every few milliseconds keep up with the rate.
    """

    count: int
    per: timedelta = timedelta(seconds=1)
    burst: int | None = None

    if TYPE_CHECKING:

        def __init__(
            self, count: int, per: timedelta | float = ..., burst: int | None = None
        ) -> None: ...

    def __post_init__(self) -> None:
        if not _whole(self.count, 1, RATE_COUNT_MAX):
            raise ValueError(_range("Rate count", 1, RATE_COUNT_MAX, self.count))
        per = _seconds(self.per)
        if not isinstance(per, timedelta) or per <= timedelta(0):
            raise ValueError(f"Rate per must be a positive duration, got {self.per!r}")
        object.__setattr__(self, "per", per)
        if self.burst is not None and not _whole(self.burst, 1, RATE_COUNT_MAX):
            raise ValueError(_range("Rate burst", 1, RATE_COUNT_MAX, self.burst))

    @property
    def per_second(self) -> float:
        return self.count / self.per.total_seconds()

    @property
    def capacity(self) -> int:
        """The bucket's size: ``burst``, or 100 ms worth of starts (at least one)."""
        if self.burst is not None:
            return self.burst
        return min(RATE_COUNT_MAX, max(1, math.ceil(self.per_second * 0.1)))

    def __str__(self) -> str:
        seconds = self.per.total_seconds()
        per = {1: "s", 60: "min", 3600: "h"}.get(int(seconds)) if seconds.is_integer() else None
        return f"{self.count}/{per or f'{seconds:g}s'}"


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

    # At most this many jobs of the type at once per worker process; None: as many as the
    # worker has slots (``runworker --concurrency``).
    concurrency: int | None = None
    timeout: timedelta = timedelta(seconds=60)
    max_attempts: int = 5
    backoff: Backoff | None = None
    queue: str | None = None
    # The Django database alias the type's jobs live in: enqueue puts them there, and only
    # ``runworker --database`` of that alias runs them. None: ``JOBS["DATABASE"]`` unless
    # enqueue names another alias, and any worker runs them where it finds them.
    database: str | None = None
    priority: int = 0
    retry_in_process_up_to: timedelta | None = None
    permanent_errors: tuple[type[BaseException], ...] = ()
    classify: Callable[[BaseException], str | None] | None = None
    # A run table this type drives: the payload field ``run_field`` holds the row's primary
    # key, and the queue keeps that row in step with the job (see jobs.queue.bound).
    run_model: type[RunContract] | None = None
    run_field: str = "run_id"
    # Flow control, held by the claim across every worker (jobs.queue.flow): at most this
    # many running at once, in all and per tenant; at most this many starts per period, in
    # all and per tenant; and a weighted fair order between tenants.
    global_concurrency: int | None = None
    tenant_concurrency: int | None = None
    rate_limit: Rate | None = None
    tenant_rate_limit: Rate | None = None
    fair: bool = False
    # Of each claim of the type, this share (0 < share < 1) goes first to due jobs below its
    # highest due priority, so a steady stream of high-priority jobs cannot starve the rest.
    lower_priority_share: float | None = None

    if TYPE_CHECKING:
        # __post_init__ normalizes durations and exception classes, so the constructor takes
        # the wider types that PolicyOptions spells out.
        def __init__(self, **options: Unpack[PolicyOptions]) -> None: ...

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
        problems = []
        if self.concurrency is not None and not _whole(self.concurrency, 1, CONCURRENCY_MAX):
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
        problems.extend(_database_problems(self.database))
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
        if self.run_model is not None:
            from jobs.runs import RunContract

            if not (
                isinstance(self.run_model, type)
                and issubclass(self.run_model, RunContract)
                and not self.run_model._meta.abstract
            ):
                problems.append(
                    f"run_model must be a concrete RunContract model, got {self.run_model!r}"
                )
        for name in ("global_concurrency", "tenant_concurrency"):
            value = getattr(self, name)
            if value is not None and not _whole(value, 1, GLOBAL_CONCURRENCY_MAX):
                problems.append(_range(name, 1, GLOBAL_CONCURRENCY_MAX, value))
        for name in ("rate_limit", "tenant_rate_limit"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Rate):
                problems.append(f"{name} must be a jobs.Rate or None, got {value!r}")
        if not isinstance(self.fair, bool):
            problems.append(f"fair must be True or False, got {self.fair!r}")
        share = self.lower_priority_share
        if share is not None and not (
            isinstance(share, int | float) and not isinstance(share, bool) and 0 < share < 1
        ):
            problems.append(
                f"lower_priority_share must be a fraction between 0 and 1 (exclusive), got "
                f"{share!r}"
            )
        return problems

    def resolved_backoff(self) -> Backoff:
        """This policy's backoff, or the settings' default."""
        return self.backoff or default_backoff()

    def in_process_limit(self) -> timedelta:
        """Retry delays up to this long are waited out in the worker; longer ones requeue."""
        if self.retry_in_process_up_to is None:
            return jobs_settings.RETRY_IN_PROCESS_UP_TO
        return self.retry_in_process_up_to


type ExceptionClasses = (
    type[BaseException]
    | tuple[type[BaseException], ...]
    | list[type[BaseException]]
    | set[type[BaseException]]
    | frozenset[type[BaseException]]
)


class PolicyOptions(TypedDict, total=False):
    """The keywords of :class:`Policy`, which :func:`jobs.job` and :func:`jobs.register` take.

    Durations may be seconds; ``permanent_errors`` may be one class or a collection of them.
    tests/unit/test_typing.py keeps the keys in step with Policy's fields.
    """

    concurrency: int | None
    timeout: timedelta | float
    max_attempts: int
    backoff: Backoff | None
    queue: str | None
    database: str | None
    priority: int
    retry_in_process_up_to: timedelta | float | None
    permanent_errors: ExceptionClasses
    classify: Callable[[BaseException], str | None] | None
    run_model: type[RunContract] | None
    run_field: str
    global_concurrency: int | None
    tenant_concurrency: int | None
    rate_limit: Rate | None
    tenant_rate_limit: Rate | None
    fair: bool
    lower_priority_share: float | None


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


def _database_problems(database: object) -> list[str]:
    """A policy's ``database`` must be one of Django's configured aliases (or None)."""
    if database is None:
        return []
    from django.conf import settings

    if isinstance(database, str) and database in settings.DATABASES:
        return []
    return [
        f"database must be an alias in settings.DATABASES ({', '.join(settings.DATABASES)}), "
        f"got {database!r}"
    ]


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _range(name: str, low: int, high: int, value: object) -> str:
    return f"{name} must be a whole number from {low} to {high}, got {value!r}"
