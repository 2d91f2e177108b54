"""A ``django.tasks`` backend that stores tasks in the jobs table.

    TASKS = {"default": {"BACKEND": "jobs.backends.PostgresBackend"}}

Functions decorated with Django's ``@task`` are enqueued as jobs of one built-in type,
``django.task.v1``, whose payload names the task function and carries its arguments. They run
under ``manage.py runworker`` like any other job type: leases, retries with backoff, drain,
metrics, and the admin's failure monitor and replay. ``get_result()`` reads the job row.

OPTIONS (all optional): ``DATABASE`` (alias, default ``"default"``), ``MAX_ATTEMPTS``
(default ``JOBS["DEFAULT_MAX_ATTEMPTS"]``), ``CONCURRENCY`` (tasks run at once per worker,
default 10) and ``TIMEOUT`` (seconds, default 300).
"""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from traceback import format_exception
from typing import Any

from django.conf import settings
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from jobs.conf import jobs_settings
from jobs.context import JobContext
from jobs.errors import Reject
from jobs.payloads import Payload
from jobs.policy import Policy

_STATUS = {
    "queued": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}
# The exception line that ends a formatted traceback: "pkg.mod.Error: message" or "KeyError".
_EXCEPTION_LINE = re.compile(r"^(?P<path>[A-Za-z_][\w.]*)(?::|$)")


class DjangoTaskV1(Payload, name="django.task.v1"):
    """A call of a ``@task`` function: its import path and JSON arguments."""

    path: str
    args: list[Any]
    kwargs: dict[str, Any]
    takes_context: bool = False
    backend: str = "default"


class PostgresBackend(BaseTaskBackend):
    """Django's task API on top of the jobs table (see the module docstring)."""

    # run_after is honoured: the job is not claimed before it.
    supports_defer = True
    # async task functions run on an event loop in the worker's handler thread.
    supports_async_task = True
    # get_result() works from any process: results live in the jobs table.
    supports_get_result = True
    # priority orders claims (higher first), as for native job types.
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database = self.options.get("DATABASE", "default")
        self.max_attempts = self.options.get("MAX_ATTEMPTS")

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        from jobs.producer import enqueue

        self.validate_task(task)
        payload = DjangoTaskV1(
            path=task.module_path,
            args=normalize_json(list(args)),
            kwargs=normalize_json(dict(kwargs)),
            takes_context=task.takes_context,
            backend=self.alias,
        )
        enqueued = enqueue(
            payload,
            queue=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            max_attempts=self.max_attempts,
            using=self.database,
        )
        result = self.get_result(str(enqueued.id))
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        from jobs.models import Job

        try:
            job = Job.objects.using(self.database).get(
                pk=int(result_id), name=DjangoTaskV1.job_name
            )
        except (ValueError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        return self._result(job)

    def _result(self, job: Any) -> TaskResult:
        payload = DjangoTaskV1.from_json(job.payload)
        task = _task(payload.path).using(
            priority=job.priority, queue_name=job.queue, run_after=job.run_after
        )
        status = _STATUS[job.state]
        result = TaskResult(
            task=task,
            id=str(job.pk),
            status=status,
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=list(payload.args),
            kwargs=dict(payload.kwargs),
            backend=self.alias,
            errors=_errors(job) if status == TaskResultStatus.FAILED else [],
            # Only the last worker is kept: one entry per attempt, naming it.
            worker_ids=[job.claimed_by or "unknown"] * job.attempts,
        )
        object.__setattr__(result, "_return_value", job.result)
        return result


def run_task(payload: DjangoTaskV1, ctx: JobContext) -> Any:
    """The worker's handler for ``django.task.v1``: call the task function."""
    from django.tasks import task_backends

    task = _task(payload.path)
    backend = task_backends[payload.backend]
    result = backend.get_result(str(ctx.id))
    task_started.send(type(backend), task_result=result)
    try:
        if payload.takes_context:
            value = task.call(TaskContext(task_result=result), *payload.args, **payload.kwargs)
        else:
            value = task.call(*payload.args, **payload.kwargs)
        value = normalize_json(value)
    except Exception as exc:
        # Sent inside the except block, as Django's receivers expect (they log exc_info).
        failed = replace(
            result,
            status=TaskResultStatus.FAILED,
            finished_at=timezone.now(),
            errors=[*result.errors, _error(exc)],
        )
        task_finished.send(type(backend), task_result=failed)
        raise
    done = replace(result, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now())
    object.__setattr__(done, "_return_value", value)
    task_finished.send(type(backend), task_result=done)
    return value


def _error(exc: BaseException) -> TaskError:
    kind = type(exc)
    return TaskError(
        exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
        traceback="".join(format_exception(exc)),
    )


BACKEND_PATH = "jobs.backends.PostgresBackend"


def task_policy() -> Policy | None:
    """The policy of ``django.task.v1`` if some TASKS backend is this one, else None."""
    for config in getattr(settings, "TASKS", {}).values():
        if config.get("BACKEND") == BACKEND_PATH:
            options = config.get("OPTIONS", {})
            return Policy(
                concurrency=options.get("CONCURRENCY", 10),
                timeout=timedelta(seconds=options.get("TIMEOUT", 300)),
                max_attempts=options.get("MAX_ATTEMPTS", jobs_settings.DEFAULT_MAX_ATTEMPTS),
            )
    return None


def _task(path: str) -> Task:
    task = import_string(path)
    if not isinstance(task, Task):
        raise Reject(f"{path} is not a django.tasks Task")
    return task


def _errors(job: Any) -> list[TaskError]:
    """The failure as Django's TaskError, the exception class read from the traceback."""
    detail = job.error_detail or job.last_error
    path = "builtins.Exception"
    for line in reversed(detail.splitlines()):
        match = _EXCEPTION_LINE.match(line)
        if match and not line.startswith(("Traceback", "During handling", "The above")):
            found = match.group("path")
            path = found if "." in found else f"builtins.{found}"
            break
    return [TaskError(exception_class_path=path, traceback=detail)]
