"""Functions written for Django's own task API, run by the jobs backend in the tests."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime

from django.tasks import TaskContext, task

from jobs import Reject


@task
def add(a: int, b: int) -> int:
    return a + b


@task(priority=50)
def urgent() -> str:
    return "done"


@task
def refuse(reason: str) -> None:
    raise Reject(reason)


@task(takes_context=True)
def introspect(context, label: str) -> dict:
    return {"label": label, "attempt": context.attempt, "id": context.task_result.id}


@task
async def async_double(n: int) -> int:
    return n * 2


@task
def flaky(marker_path: str) -> str:
    """Fails on its first run (no marker file yet), succeeds on the retry."""
    from pathlib import Path

    marker = Path(marker_path)
    if not marker.exists():
        marker.write_text("failed once")
        raise ConnectionError("first attempt fails")
    return "second time lucky"


# -- failure cases: what get_result() reports for each (docs/tasks.md) ---------------------


class TaskProblem(Reject):
    """A rejection defined next to the tasks: its path is not builtins, and it never retries."""


@task
def echo(*args, **kwargs) -> object:
    """Returns what it was given, as the task received it."""
    return args[0] if len(args) == 1 and not kwargs else {"args": list(args), "kwargs": kwargs}


@task
def returns_datetime() -> datetime:
    return datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


@task
def returns_object() -> object:
    return object()


@task
def returns_nan() -> dict:
    return {"ratio": float("nan")}


@task
def returns_infinity() -> list:
    return [1, float("inf")]


@task
def returns_nul() -> str:
    return "a\x00b"


@task
def returns_normalized() -> dict:
    """Tuples and UTF-8 bytes are JSON after Django's normalize_json: a list and a str."""
    return {"pair": (1, 2), "raw": b"ok", "nested": [{"n": None}]}


@task
def exits() -> None:
    raise SystemExit(3)


@task
def interrupts() -> None:
    raise KeyboardInterrupt


@task
def raises_multiline() -> None:
    """A message whose second line looks like an exception line, and a note."""
    error = TaskProblem("first line\nSecondLine: not an exception class")
    error.add_note("a note")
    raise error


@task
def raises_quoting_a_traceback() -> None:
    """A message that quotes another traceback, as errors relayed from elsewhere do."""
    raise TaskProblem(
        'upstream failed:\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "OtherError: remote"
    )


@task
def raises_chained() -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        raise TaskProblem("lookup failed") from exc


@task
async def raises_group() -> None:
    raise ExceptionGroup("two failed", [ValueError("one"), TypeError("two")])


def plain_function() -> str:
    """Not a Task: a payload naming it cannot run."""
    return "not a task"


# -- the contract of Django's task API (tests/integration/api/test_tasks_contract.py) --------


@task
def fails(message: str) -> None:
    raise ValueError(message)


@task
def returns_set() -> set:
    return {1, 2}


@task
def retries_later(marker_path: str) -> str:
    """Its first attempt goes back to the queue for an hour; a later one succeeds."""
    from pathlib import Path

    from jobs import RetryAfter

    marker = Path(marker_path)
    if not marker.exists():
        marker.write_text("waited once")
        raise RetryAfter(3600, "come back in an hour")
    return "done"


@task(takes_context=True)
def reports_its_context(context, marker_path: str) -> dict:
    """What the context says on each attempt; the first attempt goes back to the queue."""
    from pathlib import Path

    from jobs import RetryAfter

    result = context.task_result
    seen = {
        "attempt": context.attempt,
        "id": result.id,
        "status": result.status,
        "attempts": result.attempts,
        "workers": len(result.worker_ids),
        "args": result.args,
        "task": result.task.module_path,
        "started": result.started_at is not None,
        "is_task_context": isinstance(context, TaskContext),
    }
    marker = Path(marker_path)
    if not marker.exists():
        marker.write_text(json.dumps(seen))
        raise RetryAfter(3600, "again later")
    return {"first": json.loads(marker.read_text()), "second": seen}


_GATES: dict[str, threading.Event] = {}


def gate(key: str) -> threading.Event:
    """The event the task ``blocks(key)`` waits for (the worker runs it in this process)."""
    return _GATES.setdefault(key, threading.Event())


@task
def blocks(key: str) -> str:
    """Runs until the test opens its gate (at most ten seconds)."""
    if not gate(key).wait(10):
        raise TimeoutError(f"the gate {key!r} was never opened")
    return key
