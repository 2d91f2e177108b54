"""Functions written for Django's own task API, run by the jobs backend in the tests."""

from __future__ import annotations

from django.tasks import task

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
