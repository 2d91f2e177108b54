"""System checks: a bad ``JOBS`` setting or job catalogue is a clear error at start-up.

Ids are stable so they can be looked up and, for warnings, silenced:

* ``jobs.E001`` unknown key in ``JOBS`` (``E007``: ``JOBS`` is not a dict)
* ``jobs.E002`` a duration setting that is not a valid duration
* ``jobs.E003`` a whole-number setting out of range; ``E008`` ``NOTIFY`` or
  ``PREPARED_STATEMENTS`` not a bool
* ``jobs.E004`` ``DEFAULT_TENANT`` / ``DEFAULT_QUEUE`` not a valid key
* ``jobs.E005`` a retention shorter than the idempotency window it must outlive
* ``jobs.E006`` ``BACKOFF_BASE`` greater than ``BACKOFF_CAP``
* ``jobs.E010`` two payload classes claim one name (only one of them can be registered)
* ``jobs.W001`` a payload class without a registered handler (its jobs would stay queued)
* ``jobs.E020`` an invalid schedule (``JOBS["SCHEDULES"]`` or ``jobs.scheduler.schedule()``)
* ``jobs.E021`` ``SCHEDULER_LEADER_TIMEOUT`` under one second (a live leader could lose it)
* ``jobs.W022`` ``DB_STATEMENT_TIMEOUT`` / ``DB_LOCK_TIMEOUT`` not below the leader timeout
* ``jobs.E023`` ``DB_NETWORK_TIMEOUT`` under one second (keepalives count whole seconds)
* ``jobs.W030`` ``PREPARED_STATEMENTS`` on for an alias reached through a pooler (a database
  check: ``manage.py check --database <alias>`` and ``migrate`` run it; ``runworker`` warns
  the same at start-up)
* ``jobs.E040`` ``DATABASE`` (or a task backend's ``DATABASE``) is not a Django alias;
  ``E041`` ``DATABASES`` is not a list of aliases, names an unknown one or leaves out one
  that holds jobs (:func:`jobs.catalogue.routing.check_databases`)
* ``jobs.E050`` a ``TASKS`` backend is ``jobs.backends.PostgresBackend`` but ``jobs`` is not
  in ``INSTALLED_APPS`` (reported through Django's task checks:
  :func:`jobs.backends.check_task_backend`)
"""

from __future__ import annotations

import difflib
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from jobs.catalogue.payloads import Payload
from jobs.catalogue.registry import MAX_ATTEMPTS_MAX, catalogue
from jobs.catalogue.routing import POOLER_HINT, behind_a_pooler, check_databases, configured
from jobs.core.conf import DEFAULTS, DURATION_KEYS, as_timedelta
from jobs.core.limits import validate_key

# Durations where zero is meaningful: no window at all, or never wait in-process.
ZERO_ALLOWED = frozenset(
    {
        "SUCCESS_WINDOW",
        "FAILURE_WINDOW",
        "RETRY_IN_PROCESS_UP_TO",
        "HANDLER_CONN_MAX_AGE",
        "ARCHIVE_AFTER",
        # A database bound of zero is off (PostgreSQL's own meaning of 0 for these timeouts).
        "DB_STATEMENT_TIMEOUT",
        "DB_LOCK_TIMEOUT",
        "DB_NETWORK_TIMEOUT",
    }
)
BOOL_KEYS = ("NOTIFY", "PREPARED_STATEMENTS")
INT_RANGES = {"DEFAULT_MAX_ATTEMPTS": (1, MAX_ATTEMPTS_MAX), "PRUNE_BATCH_SIZE": (1, None)}
# A terminal row must outlive the window in which it holds its job_id, or pruning it lets a
# repeat enqueue run the work again.
RETENTION_WINDOWS = (
    ("SUCCEEDED_RETENTION", "SUCCESS_WINDOW"),
    ("FAILED_RETENTION", "FAILURE_WINDOW"),
    ("CANCELLED_RETENTION", "FAILURE_WINDOW"),
)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Check ``settings.JOBS`` as written (not through the cached reader)."""
    user = getattr(settings, "JOBS", None)
    if user is None:
        user = {}
    if not isinstance(user, dict):
        return [
            Error(
                f"JOBS must be a dict, got {type(user).__name__}.",
                hint="Set JOBS = {...} with the keys you want to change, or leave it out.",
                id="jobs.E007",
            )
        ]
    errors: list[CheckMessage] = [_unknown(key) for key in user if key not in DEFAULTS]
    values = {**DEFAULTS, **{key: user[key] for key in user if key in DEFAULTS}}
    durations: dict[str, timedelta] = {}
    for key in sorted(DURATION_KEYS):
        duration, error = _duration(key, values[key])
        if error:
            errors.append(error)
        elif duration is not None:  # always, without an error; the type checker needs telling
            durations[key] = duration
    errors.extend(_ints(values))
    errors.extend(_keys(values))
    errors.extend(
        Error(f"JOBS[{key!r}] must be True or False, got {values[key]!r}.", id="jobs.E008")
        for key in BOOL_KEYS
        if not isinstance(values[key], bool)
    )
    errors.extend(_consistency(durations))
    return errors


def check_registry(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Payload classes the registry cannot see: name clashes and types nobody handles."""
    classes = _payload_classes()
    registry = catalogue.get() if catalogue.frozen else None
    by_name: dict[str, list[type[Payload]]] = {}
    for cls in classes:
        by_name.setdefault(cls.job_name, []).append(cls)
    messages: list[CheckMessage] = []
    for name, owners in sorted(by_name.items()):
        if len(owners) > 1:
            messages.append(
                Error(
                    f"Payload classes {', '.join(_label(cls) for cls in owners)} all claim the "
                    f"job name {name!r}.",
                    hint="Give each contract its own versioned name, e.g. by bumping .vN.",
                    id="jobs.E010",
                )
            )
        elif registry is not None and name not in registry:
            messages.append(
                Warning(
                    f"Payload class {_label(owners[0])} ({name!r}) has no registered handler.",
                    hint=(
                        f"Register one with @job({owners[0].__name__}) in <app>/jobs.py; until "
                        f"a worker registers the name, its jobs stay queued."
                    ),
                    id="jobs.W001",
                )
            )
    return messages


def _unknown(key: object) -> CheckMessage:
    close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
    hint = f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(sorted(DEFAULTS))}."
    return Error(f"JOBS has an unknown key {key!r}.", hint=hint, id="jobs.E001")


def _duration(key: str, value: Any) -> tuple[timedelta, None] | tuple[None, CheckMessage]:
    zero_ok = key in ZERO_ALLOWED
    try:
        duration = as_timedelta(value)
    except (TypeError, ValueError, OverflowError):
        duration = None
    if duration is not None and (duration > timedelta(0) or (zero_ok and not duration)):
        return duration, None
    wanted = "zero or a positive duration" if zero_ok else "a positive duration"
    return None, Error(
        f"JOBS[{key!r}] must be {wanted}, got {value!r}.",
        hint="Give a datetime.timedelta or a number of seconds.",
        id="jobs.E002",
    )


def _ints(values: dict[str, Any]) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for key, (low, high) in INT_RANGES.items():
        value = values[key]
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole or value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
            errors.append(
                Error(
                    f"JOBS[{key!r}] must be a whole number {bounds}, got {value!r}.", id="jobs.E003"
                )
            )
    return errors


def _keys(values: dict[str, Any]) -> list[CheckMessage]:

    errors: list[CheckMessage] = []
    for key, what in (("DEFAULT_TENANT", "tenant"), ("DEFAULT_QUEUE", "queue")):
        try:
            validate_key(values[key], what)
        except ValueError as exc:
            errors.append(Error(f"JOBS[{key!r}] is invalid: {exc}.", id="jobs.E004"))
    return errors


def _consistency(durations: dict[str, timedelta]) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for retention, window in RETENTION_WINDOWS:
        if durations.get(retention, timedelta.max) < durations.get(window, timedelta(0)):
            errors.append(
                Error(
                    f"JOBS[{retention!r}] ({durations[retention]}) is shorter than "
                    f"JOBS[{window!r}] ({durations[window]}).",
                    hint=(
                        f"Rows would be pruned while they still hold their job_id, so a "
                        f"repeat enqueue inside {window} would run the work again. "
                        f"Raise {retention} or lower {window}."
                    ),
                    id="jobs.E005",
                )
            )
    base, cap = durations.get("BACKOFF_BASE"), durations.get("BACKOFF_CAP")
    if base is not None and cap is not None and base > cap:
        errors.append(
            Error(
                f"JOBS['BACKOFF_BASE'] ({base}) is greater than JOBS['BACKOFF_CAP'] ({cap}).",
                hint="The first retry would already wait longer than the cap allows.",
                id="jobs.E006",
            )
        )
    return errors


def _payload_classes() -> list[type[Payload]]:
    """Every Payload class made. A class whose definition raised (a missing or invalid name)
    stays among its base's subclasses until it is collected, without a name: left out."""
    found: list[type[Payload]] = []
    stack = list(Payload.__subclasses__())
    while stack:
        cls = stack.pop()
        if hasattr(cls, "job_name"):
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return sorted(set(found), key=_label)


def _label(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@register("jobs")
def check_schedules(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every schedule must parse, name a registered job type and carry a payload it accepts."""
    from jobs.catalogue.schedules import schedule_problems

    if not catalogue.frozen:
        return []  # the registry is built at start-up; the scheduler validates again then
    return [
        Error(
            f"Invalid schedule: {problem}.",
            hint="See docs/scheduler.md for the schedule options.",
            id="jobs.E020",
        )
        for problem in schedule_problems()
    ]


@register("jobs")
def check_scheduler_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The leader proves itself a few times per timeout; under a second is too tight."""
    user = getattr(settings, "JOBS", None)
    if not isinstance(user, dict) or "SCHEDULER_LEADER_TIMEOUT" not in user:
        return []
    try:
        timeout = as_timedelta(user["SCHEDULER_LEADER_TIMEOUT"])
    except (TypeError, ValueError, OverflowError):
        return []  # reported as jobs.E002
    if timedelta(0) < timeout < timedelta(seconds=1):
        return [
            Error(
                f"JOBS['SCHEDULER_LEADER_TIMEOUT'] ({timeout}) is shorter than one second.",
                hint="A leader that pauses briefly would lose its session; use a few seconds.",
                id="jobs.E021",
            )
        ]
    return []


@register("jobs")
def check_database_bounds(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The bounds of jobs.db.bounds must fit the leader timeout and the TCP stack."""
    values = _user_durations(
        (
            "DB_STATEMENT_TIMEOUT",
            "DB_LOCK_TIMEOUT",
            "DB_NETWORK_TIMEOUT",
            "SCHEDULER_LEADER_TIMEOUT",
        )
    )
    messages: list[CheckMessage] = []
    leader = values.get("SCHEDULER_LEADER_TIMEOUT")
    for key in ("DB_STATEMENT_TIMEOUT", "DB_LOCK_TIMEOUT"):
        bound = values.get(key)
        if bound and leader and bound >= leader:
            messages.append(
                Warning(
                    f"JOBS[{key!r}] ({bound}) is not shorter than "
                    f"JOBS['SCHEDULER_LEADER_TIMEOUT'] ({leader}).",
                    hint=(
                        "A scheduler statement that runs into this bound makes the leader step "
                        "down (its loop has not moved for SCHEDULER_LEADER_TIMEOUT) instead of "
                        "being cancelled and retried; keep it well below "
                        "SCHEDULER_LEADER_TIMEOUT."
                    ),
                    id="jobs.W022",
                )
            )
    network = values.get("DB_NETWORK_TIMEOUT")
    if network and network < timedelta(seconds=1):
        messages.append(
            Error(
                f"JOBS['DB_NETWORK_TIMEOUT'] ({network}) is shorter than one second.",
                hint=(
                    "TCP keepalive probes count whole seconds; use a few seconds, or 0 to "
                    "leave the operating system's defaults."
                ),
                id="jobs.E023",
            )
        )
    return messages


@register("jobs", Tags.database)
def check_prepared_statements(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """With ``PREPARED_STATEMENTS`` on, warn of each alias whose connection goes through a
    pooler (:func:`jobs.catalogue.routing.behind_a_pooler`); a warning, to silence once the
    pooler is known to keep prepared statements."""
    if not databases:
        return []
    holding = configured()
    return [
        Warning(problem, hint=POOLER_HINT, id="jobs.W030")
        for alias in databases
        if alias in holding and (problem := behind_a_pooler(alias))
    ]


def _user_durations(keys: tuple[str, ...]) -> dict[str, timedelta]:
    """The valid durations among ``keys`` (defaults where unset); invalid ones are E002's."""
    user = getattr(settings, "JOBS", None)
    user = user if isinstance(user, dict) else {}
    found: dict[str, timedelta] = {}
    for key in keys:
        duration, error = _duration(key, user.get(key, DEFAULTS[key]))
        if duration is not None and error is None:
            found[key] = duration
    return found


register(check_databases, "jobs")
