"""Schedules: declared in settings or in code, validated whole at start-up, then immutable.

In settings, by name::

    JOBS = {"SCHEDULES": {
        "nightly-report": {
            "cron": "0 3 * * *",              # 5 fields, or 6 with seconds last
            "job": "reports.nightly.v1",      # a registered job type
            "payload": {"kind": "daily"},     # decoded and validated by the type's payload class
            "misfire": "once",                # skip (default) | once | all
            "timezone": "Europe/Berlin",      # default: settings.TIME_ZONE
            # optional: a new schedule's first tick treats slots from here on as due (the
            # misfire policy decides about those already missed); without it, only the
            # current slot fires
            "catch_up_from": "2026-01-01T00:00",
        },
    }}

In code, next to the job type (``<app>/jobs.py``, imported at start-up)::

    schedule("nightly-report", "0 3 * * *", NightlyReportV1(kind="daily"), misfire="once")

Every problem (a bad expression or time zone, an unknown job type, a payload its type refuses,
an unknown option, a name used twice) is reported at once, by the system check ``jobs.E020``
and by ``runscheduler`` before it starts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from jobs.catalogue import timing
from jobs.catalogue.payloads import InvalidPayload, Payload
from jobs.catalogue.registry import Registry, get_registry
from jobs.catalogue.timing import Decision, Misfire
from jobs.core.conf import as_timedelta, jobs_settings
from jobs.core.limits import validate_key

MAX_CATCH_UP_LIMIT = 1000
OPTIONS = frozenset(
    {
        "cron",
        "job",
        "payload",
        "misfire",
        "timezone",
        "max_catch_up",
        "tenant",
        "grace",
        "catch_up_from",
    }
)


@dataclass(frozen=True)
class Schedule:
    """A validated schedule: when (``cron`` in ``timezone``), what (``payload``), and what to
    do about slots missed while no scheduler ran (``misfire``)."""

    name: str
    cron: str
    payload: Payload
    timezone: ZoneInfo
    misfire: str = Misfire.SKIP
    max_catch_up: int = 10  # misfire "all": at most this many missed slots fire
    tenant: str | None = None
    grace: timedelta | None = None  # None: JOBS["MISFIRE_GRACE"]
    # A new schedule's first tick fires only its current slot; with this, every slot from
    # here on counts, so the misfire policy decides about the ones already past.
    catch_up_from: datetime | None = None

    @property
    def job(self) -> str:
        return self.payload.job_name

    @property
    def misfire_grace(self) -> timedelta:
        return self.grace if self.grace is not None else jobs_settings.MISFIRE_GRACE

    def job_id(self, slot: datetime) -> str:
        """The idempotency key of the job a slot fires: the same slot always gets the same key."""
        return f"cron:{self.name}:{slot.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"

    def next_slot(self, after: datetime) -> datetime:
        return timing.next_slot(self.cron, self.timezone, after)

    def first_due(self, now: datetime) -> datetime:
        """The slot this schedule fires first while it has recorded nothing."""
        return timing.first_due(
            self.cron, self.timezone, now=now, grace=self.misfire_grace, start=self.catch_up_from
        )

    def skipped_while_paused(
        self, *, last: datetime | None, since: datetime, now: datetime
    ) -> Decision | None:
        """What a resume records: see :func:`jobs.catalogue.timing.skipped_while_paused`."""
        return timing.skipped_while_paused(
            self.cron, self.timezone, last=last, since=since, now=now
        )

    def plan(self, now: datetime, last: datetime | None) -> list[Decision]:
        """What to record at ``now`` after ``last``: see :func:`jobs.catalogue.timing.plan`."""
        return timing.plan(
            self.cron,
            self.timezone,
            now=now,
            last=last,
            grace=self.misfire_grace,
            misfire=self.misfire,
            max_catch_up=self.max_catch_up,
            start=self.catch_up_from,
        )


# Schedules declared in code, in declaration order: (where, name, options).
_declared: list[tuple[str, str, dict[str, Any]]] = []
_loaded: tuple[Schedule, ...] | None = None


def schedule(
    name: str,
    cron: str,
    payload: Payload,
    *,
    misfire: str = Misfire.SKIP,
    timezone: str | None = None,
    max_catch_up: int = 10,
    tenant: str | None = None,
    grace: timedelta | float | None = None,
    catch_up_from: datetime | str | None = None,
) -> None:
    """Declare a schedule in code, next to its job type; validated with the others at start-up."""
    where = sys._getframe(1).f_globals.get("__name__", "?")
    options = {"cron": cron, "payload": payload, "misfire": misfire, "max_catch_up": max_catch_up}
    options.update(
        {"timezone": timezone, "tenant": tenant, "grace": grace, "catch_up_from": catch_up_from}
    )
    _declared.append((where, name, {k: v for k, v in options.items() if v is not None}))


def get_schedules() -> tuple[Schedule, ...]:
    """Every configured schedule, validated once (and again after ``JOBS`` changes)."""
    global _loaded
    if _loaded is None:
        _loaded = load_schedules()
    return _loaded


def load_schedules(
    configured: Mapping[str, Any] | None = None,
    declared: Iterable[tuple[str, str, Mapping[str, Any]]] | None = None,
    registry: Registry | None = None,
) -> tuple[Schedule, ...]:
    """Validate ``JOBS["SCHEDULES"]`` and the code declarations; raise listing every problem."""
    schedules, problems = _build_all(configured, declared, registry)
    if problems:
        raise ImproperlyConfigured(
            "Invalid schedules:\n" + "\n".join(f"  - {problem}" for problem in problems)
        )
    return schedules


def schedule_problems(
    configured: Mapping[str, Any] | None = None,
    declared: Iterable[tuple[str, str, Mapping[str, Any]]] | None = None,
    registry: Registry | None = None,
) -> list[str]:
    """Every problem with the configured schedules, as sentences (for the system check)."""
    return _build_all(configured, declared, registry)[1]


def _build_all(
    configured: Mapping[str, Any] | None,
    declared: Iterable[tuple[str, str, Mapping[str, Any]]] | None,
    registry: Registry | None,
) -> tuple[tuple[Schedule, ...], list[str]]:
    configured = jobs_settings.SCHEDULES if configured is None else configured
    declared = list(_declared if declared is None else declared)
    registry = get_registry() if registry is None else registry
    if not isinstance(configured, Mapping):
        return (), [f"JOBS['SCHEDULES'] must be a dict of schedules by name, got {configured!r}"]
    sources = [(f"JOBS['SCHEDULES'][{name!r}]", name, spec) for name, spec in configured.items()]
    sources += [
        (f"schedule {name!r} declared in {where}", name, spec) for where, name, spec in declared
    ]
    schedules: dict[str, Schedule] = {}
    seen: dict[str, str] = {}
    problems: list[str] = []
    for label, name, spec in sources:
        if name in seen:
            problems.append(f"{label}: the name is already used by {seen[name]}")
            continue
        seen[name] = label
        built, found = _build(name, spec, registry)
        problems.extend(f"{label}: {problem}" for problem in found)
        if built is not None:
            schedules[name] = built
    return tuple(schedules[name] for name in sorted(schedules)), problems


def _build(name: object, spec: object, registry: Registry) -> tuple[Schedule | None, list[str]]:

    if not isinstance(spec, Mapping):
        return None, [f"must be a dict of options, got {type(spec).__name__}"]
    problems = [
        f"unknown option {key!r} (options: {', '.join(sorted(OPTIONS))})"
        for key in spec
        if key not in OPTIONS
    ]
    try:
        validate_key(name, "the schedule name")
    except ValueError as exc:
        problems.append(str(exc))
    cron = spec.get("cron")
    if (problem := timing.check_expression(cron)) is not None:
        problems.append(problem)
    zone, problem = _zone(spec.get("timezone"))
    if problem:
        problems.append(problem)
    payload, problem = _payload(spec.get("job"), spec.get("payload", {}), registry)
    if problem:
        problems.append(problem)
    misfire = spec.get("misfire", Misfire.SKIP)
    if misfire not in Misfire.values:
        problems.append(f"misfire must be one of {', '.join(Misfire.values)}, got {misfire!r}")
    max_catch_up = spec.get("max_catch_up", 10)
    if (
        isinstance(max_catch_up, bool)
        or not isinstance(max_catch_up, int)
        or not 1 <= max_catch_up <= MAX_CATCH_UP_LIMIT
    ):
        problems.append(
            f"max_catch_up must be a whole number from 1 to {MAX_CATCH_UP_LIMIT}, "
            f"got {max_catch_up!r}"
        )
    tenant = spec.get("tenant")
    if tenant is not None:
        try:
            validate_key(tenant, "tenant")
        except ValueError as exc:
            problems.append(str(exc))
    grace, problem = _grace(spec.get("grace"))
    if problem:
        problems.append(problem)
    start, problem = _instant(spec.get("catch_up_from"), zone)
    if problem:
        problems.append(problem)
    if problems:
        return None, problems
    return (
        Schedule(str(name), str(cron), payload, zone, misfire, max_catch_up, tenant, grace, start),
        [],
    )


def _zone(value: object) -> tuple[ZoneInfo, str | None]:
    name = value if value is not None else (settings.TIME_ZONE or "UTC")
    if isinstance(name, str):  # ZoneInfo raises TypeError for anything else
        try:
            return ZoneInfo(name), None
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            pass
    return ZoneInfo("UTC"), f"timezone {name!r} is not a known IANA time zone"


def _payload(job: object, data: object, registry: Registry) -> tuple[Any, str | None]:
    """The payload value the schedule enqueues, decoded and validated by its registered type."""
    if isinstance(data, Payload):
        if job is not None and job != data.job_name:
            return None, f"job {job!r} does not match the payload's type {data.job_name!r}"
        job, data = data.job_name, data.to_json()
    if not isinstance(job, str) or not job:
        return None, "job must name a registered job type, e.g. 'reports.nightly.v1'"
    job_type = registry.get(job)
    if job_type is None:
        return None, f"job type {job!r} is not registered (register it with @job in <app>/jobs.py)"
    try:
        return job_type.payload_type.from_json(data), None
    except InvalidPayload as exc:
        return None, f"invalid payload for {job}: {exc}"


def _grace(value: object) -> tuple[timedelta | None, str | None]:
    if value is None:
        return None, None
    try:
        grace = as_timedelta(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        grace = None
    if grace is None or grace <= timedelta(0):
        return None, f"grace must be a positive duration, got {value!r}"
    return grace, None


def _instant(value: object, zone: ZoneInfo) -> tuple[datetime | None, str | None]:
    """``catch_up_from``: an aware datetime, or an ISO 8601 string; naive means the schedule's
    own time zone, as its cron expression does."""
    if value is None:
        return None, None
    instant = value
    if isinstance(value, str):
        try:
            instant = datetime.fromisoformat(value)
        except ValueError:
            instant = None
    if not isinstance(instant, datetime):
        return None, (
            f"catch_up_from must be a datetime or an ISO 8601 date and time, "
            f"e.g. '2026-01-01T00:00:00+00:00', got {value!r}"
        )
    if instant.tzinfo is None or instant.utcoffset() is None:
        # Read like a cron slot: a time in a daylight-saving gap is the instant of the jump.
        instant = timing.resolve(instant.replace(tzinfo=None), zone)
    return instant, None


def _reset(*, setting: str, **kwargs: Any) -> None:
    global _loaded
    if setting in ("JOBS", "TIME_ZONE"):
        _loaded = None


setting_changed.connect(_reset)
