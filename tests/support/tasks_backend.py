"""Helpers for the tests of Django's task API on the jobs backend (``jobs.backends``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.dispatch import Signal
from django.test import override_settings
from django.utils import timezone

BACKEND = "jobs.backends.PostgresBackend"


def backend_settings(**options: Any) -> override_settings:
    """``TASKS`` with this backend as ``default``; keyword arguments become its OPTIONS, except
    ``QUEUES``, which is the backend's list of queues."""
    queues = options.pop("QUEUES", None)
    config: dict[str, Any] = {"BACKEND": BACKEND, "OPTIONS": options}
    if queues is not None:
        config["QUEUES"] = queues
    return override_settings(TASKS={"default": config})


def one_attempt() -> override_settings:
    """Tasks enqueued under it get a single attempt: a failure is final at once."""
    return backend_settings(MAX_ATTEMPTS=1)


def make_due(result_id: str) -> None:
    """Let a task whose retry waits (or whose ``run_after`` is ahead) be claimed now."""
    from jobs.models import Job

    Job.objects.filter(pk=int(result_id)).update(run_after=timezone.now())


@contextmanager
def received(signal: Signal) -> Iterator[list[tuple[type, Any]]]:
    """``(sender, task_result)`` of every sending of a task signal while inside."""
    seen: list[tuple[type, Any]] = []

    def receiver(sender: type, task_result: Any, **kwargs: Any) -> None:
        seen.append((sender, task_result))

    signal.connect(receiver, weak=False, dispatch_uid=f"tasks-support-{id(seen)}")
    try:
        yield seen
    finally:
        signal.disconnect(dispatch_uid=f"tasks-support-{id(seen)}")
