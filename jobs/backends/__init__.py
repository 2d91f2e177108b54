"""A ``django.tasks`` backend that stores tasks in the jobs table.

    TASKS = {"default": {"BACKEND": "jobs.backends.PostgresBackend"}}

Functions decorated with Django's ``@task`` are enqueued as jobs of one built-in type,
``django.task.v1``, whose payload names the task function and carries its arguments. They run
under ``manage.py runworker`` like any other job type: leases, retries with backoff, drain,
metrics, and the admin's failure monitor and replay. ``get_result()`` reads the job row and
never imports the task, so results stay readable after a task is removed.

A task's own exceptions retry like any handler's (``Reject`` ends at once); what retrying
cannot fix fails at once as ``rejected``: a task that cannot be imported or is not a
``Task``, a return value that is not JSON, a ``BaseException`` that is not an ``Exception``,
a backend alias no longer configured. Arguments that are not JSON are refused at enqueue.
docs/tasks.md has the table of every case and what ``get_result()`` then reports. How a task
is stored as a job row, and read back, is :mod:`jobs.backends.records`.

OPTIONS (all optional): ``DATABASE`` (alias, default ``JOBS["DATABASE"]``), ``MAX_ATTEMPTS``
(default ``JOBS["DEFAULT_MAX_ATTEMPTS"]``), ``CONCURRENCY`` (tasks run at once per worker,
default: as many as the worker's ``--concurrency``) and ``TIMEOUT`` (seconds, default 300).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from traceback import format_exception
from typing import Any, cast

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TASK_REFRESH_ATTRS, TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.module_loading import import_string

from jobs.backends.records import DjangoTaskV1 as DjangoTaskV1
from jobs.backends.records import (
    class_path,
    errors,
    stored_payload,
    stored_task,
    to_json,
    worker_ids,
)
from jobs.catalogue.policy import Policy
from jobs.core.conf import jobs_settings
from jobs.core.context import JobContext
from jobs.core.limits import validate_key
from jobs.core.progress import Progress
from jobs.core.progress import read as read_progress
from jobs.errors import Reject, fail_now

_STATUS = {
    "queued": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


# django-stubs declare these generic and not frozen; Django's own are frozen and take no type
# arguments at run time.
@dataclass(frozen=True, slots=True, kw_only=True)
class JobTaskResult(TaskResult):  # type: ignore[misc, type-arg]
    """Django's ``TaskResult`` with the task's last progress report (:mod:`jobs.core.progress`).

    ``progress`` is None until the task reports; :meth:`refresh` reads it again too.
    """

    progress: Progress | None = None

    def refresh(self) -> None:
        """Reload the task's state, its progress included, from the jobs table."""
        self._update(self.task.get_backend().get_result(self.id))

    async def arefresh(self) -> None:
        self._update(await self.task.get_backend().aget_result(self.id))

    def _update(self, fresh: TaskResult[..., Any]) -> None:
        for attr in (*TASK_REFRESH_ATTRS, "progress"):
            object.__setattr__(self, attr, getattr(fresh, attr, None))


@dataclass(frozen=True, slots=True, kw_only=True)
class JobTaskContext(TaskContext):  # type: ignore[misc, type-arg]
    """Django's ``TaskContext`` (``@task(takes_context=True)``), able to report progress."""

    job_context: JobContext

    def progress(self, done: int, total: int | None = None, note: str = "") -> None:
        """Report how far the task got: :meth:`jobs.JobContext.progress`."""
        self.job_context.progress(done, total, note)


class PostgresBackend(BaseTaskBackend):
    """Django's task API on top of the jobs table (see the module docstring)."""

    # run_after is honoured: the job is not claimed before it.
    supports_defer = True
    # async task functions run on the worker's shared event loop (jobs.worker.event_loop).
    supports_async_task = True
    # get_result() works from any process: results live in the jobs table.
    supports_get_result = True
    # priority orders claims (higher first), as for native job types.
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # The alias the backend's tasks live in; unset, where unbound job types go.
        self.database = self.options.get("DATABASE") or jobs_settings.DATABASE
        self.max_attempts = self.options.get("MAX_ATTEMPTS")

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """Django's checks of this backend: ``jobs.E050`` when the jobs app is missing."""
        return [*super().check(**kwargs), *check_task_backend(self.alias)]

    def validate_task(self, task: Task[..., Any]) -> None:
        """Django's checks, and a queue name the jobs table can hold: with ``QUEUES = []``
        Django accepts any name, which would otherwise fail only when enqueued."""

        super().validate_task(task)
        try:
            validate_key(task.queue_name, "queue")
        except ValueError as exc:
            raise InvalidTask(
                f"Queue {task.queue_name!r} is not valid for backend: {exc}."
            ) from None

    def enqueue[**P, R](
        self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]
    ) -> TaskResult[P, R]:
        from jobs.api.producer import enqueue

        self.validate_task(task)
        payload = DjangoTaskV1(
            path=task.module_path,
            args=to_json(list(args), "args"),
            kwargs=to_json(dict(kwargs), "kwargs"),
            takes_context=task.takes_context,
            backend=self.alias,
            run_after=task.run_after,
        )
        enqueued = enqueue(
            payload,
            queue=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            max_attempts=self.max_attempts,
            using=self.database,
        )
        # Read back from the row just written: the result of this very task.
        result = cast("TaskResult[P, R]", self.get_result(str(enqueued.id)))
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """The task's row, in the jobs table or, once finished and archived, in its history.

        The archive moves a row in one statement, so reading the jobs table first and the
        history second never misses it; replay moves it back, so the jobs table is read
        once more before giving up.
        """
        return self._result_in(result_id, self.database)

    def _result_in(self, result_id: str, using: str) -> TaskResult[..., Any]:
        """:meth:`get_result` from the alias ``using`` (where a worker claimed the task)."""
        from jobs.models import Job, JobHistory

        pk = _job_pk(result_id)
        if pk is None:
            raise TaskResultDoesNotExist(result_id)
        for model in (Job, JobHistory, Job):
            found = model._default_manager.using(using).filter(pk=pk, name=DjangoTaskV1.job_name)
            for job in found:
                return self._result(job)
        raise TaskResultDoesNotExist(result_id)

    def _result(self, job: Any) -> TaskResult[..., Any]:
        payload = stored_payload(job.payload)
        task = stored_task(
            payload.path,
            priority=job.priority,
            backend=self.alias,
            queue_name=job.queue,
            run_after=payload.run_after,
            takes_context=payload.takes_context,
        )
        from jobs.queue import attempts

        listed = attempts.of(job)
        started = [a.started_at for a in listed if a.started_at is not None]
        result: TaskResult[..., Any] = JobTaskResult(
            task=task,
            id=str(job.pk),
            status=_STATUS[job.state],
            enqueued_at=job.created_at,
            # Django's started_at is the first attempt's start; last_attempted_at the latest's.
            started_at=started[0] if started else job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=started[-1] if started else job.started_at,
            args=list(payload.args),
            kwargs=dict(payload.kwargs),
            backend=self.alias,
            errors=errors(job, listed),
            worker_ids=worker_ids(job, listed),
            progress=read_progress(job.progress),
        )
        object.__setattr__(result, "_return_value", job.result)
        return result


def _job_pk(result_id: object) -> int | None:
    """The job a result id names: the id must be the row's number exactly as ``str()`` writes
    it. ``int()`` also reads ``" 7"``, ``"+7"``, ``"07"``, ``"7_0"`` and other scripts'
    digits (an Arabic-Indic seven), which are not the id of any result."""
    if not isinstance(result_id, str):
        return None
    try:
        pk = int(result_id)
    except ValueError:
        return None
    return pk if str(pk) == result_id else None


def run_task(payload: DjangoTaskV1, ctx: JobContext) -> Any:
    """The worker's handler for ``django.task.v1``: call the task function.

    What cannot succeed however often it is tried fails at once as ``rejected``: a backend
    alias that is not this backend, a task that cannot be imported or is not a ``Task`` (a
    :class:`~jobs.Reject` whose message says why), a return value that is not JSON (a
    ``TypeError`` or ``ValueError`` naming the value) and a ``BaseException`` that is not an
    ``Exception`` (``SystemExit``, ``KeyboardInterrupt``), the last two under their own class,
    as Django's backends report them. Any other exception is the task's own and follows the
    type's retry policy.
    """
    backend = _backend(payload.backend)
    # Read where the job was claimed: ids are per database, and the backend's DATABASE may
    # have moved since this task was enqueued.
    try:
        task = _import_task(payload.path)
    except Reject as exc:
        _finished(backend, backend._result_in(str(ctx.id), ctx.using), exc)
        raise
    result = backend._result_in(str(ctx.id), ctx.using)
    task_started.send(type(backend), task_result=result)
    try:
        if payload.takes_context:
            context = JobTaskContext(task_result=result, job_context=ctx)
            value = _stored_result(task.call(context, *payload.args, **payload.kwargs), payload)
        else:
            value = _stored_result(task.call(*payload.args, **payload.kwargs), payload)
    except BaseException as exc:
        if not isinstance(exc, Exception):
            # These exceptions mean "stop", never "try later".
            exc.add_note(
                f"{payload.path} raised {class_path(type(exc))}, which is not an Exception: "
                "the task fails without a retry"
            )
            fail_now(exc)
        _finished(backend, result, exc)
        raise
    done = replace(result, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now())
    object.__setattr__(done, "_return_value", value)
    task_finished.send(type(backend), task_result=done)
    return value


def _stored_result(value: Any, payload: DjangoTaskV1) -> Any:
    """The task's return value as the JSON the job stores; a value that is not JSON raises,
    marked to fail the task at once, since it would be returned again on every retry."""
    try:
        return to_json(value, "result")
    except (TypeError, ValueError) as exc:
        error = type(exc)(f"{payload.path} returned a value that is not JSON: {exc}")
    error.add_note("a value that is not JSON cannot be stored: the task fails without a retry")
    raise fail_now(error)


def _finished(backend: PostgresBackend, result: TaskResult[..., Any], exc: BaseException) -> None:
    """Send ``task_finished`` for a failed attempt; call it inside the ``except`` block.

    Django's own receivers log ``sys.exc_info()``, so the exception must be the one handled.
    """
    failed = replace(
        result,
        status=TaskResultStatus.FAILED,
        finished_at=timezone.now(),
        errors=[*result.errors, _error(exc)],
    )
    task_finished.send(type(backend), task_result=failed)


def _backend(alias: str) -> PostgresBackend:
    """The TASKS backend that enqueued the job; Reject when settings no longer name it."""
    from django.tasks import task_backends
    from django.tasks.exceptions import InvalidTaskBackend

    try:
        backend = task_backends[alias]
    except InvalidTaskBackend as exc:
        raise Reject(f"TASKS has no backend {alias!r}, the one that enqueued this task") from exc
    if not isinstance(backend, PostgresBackend):
        raise Reject(f"TASKS[{alias!r}] is {class_path(type(backend))}, not {BACKEND_PATH}")
    return backend


def _import_task(path: str) -> Task[..., Any]:
    """Import the task a payload names; Reject when it is gone or is not a ``Task``."""
    try:
        task = import_string(path)
    except ImportError as exc:  # ModuleNotFoundError too, and "doesn't look like a path"
        raise Reject(f"task {path} cannot be imported: {exc}") from exc
    if not isinstance(task, Task):
        raise Reject(f"{path} is a {type(task).__qualname__}, not a django.tasks Task")
    return task


def _error(exc: BaseException) -> TaskError:
    return TaskError(
        exception_class_path=class_path(type(exc)), traceback="".join(format_exception(exc))
    )


BACKEND_PATH = "jobs.backends.PostgresBackend"


def task_policy() -> Policy | None:
    """The policy of ``django.task.v1`` if some TASKS backend is this one, else None."""
    for config in getattr(settings, "TASKS", {}).values():
        if config.get("BACKEND") == BACKEND_PATH:
            options = config.get("OPTIONS", {})
            return Policy(
                concurrency=options.get("CONCURRENCY"),
                timeout=timedelta(seconds=options.get("TIMEOUT", 300)),
                max_attempts=options.get("MAX_ATTEMPTS", jobs_settings.DEFAULT_MAX_ATTEMPTS),
            )
    return None


def check_task_backend(alias: str) -> list[CheckMessage]:
    """The ``TASKS`` backend ``alias`` of this app needs the app: its tables and its worker.

    Called by ``PostgresBackend.check()``, which Django's task checks call for every backend
    (the checks registered above run only when the app is installed).
    """
    from django.apps import apps

    if apps.is_installed("jobs"):
        return []
    return [
        Error(
            f"TASKS[{alias!r}] uses {BACKEND_PATH}, but the jobs app is not installed.",
            hint=(
                "Add 'jobs' to INSTALLED_APPS and run migrate: the backend keeps its tasks in "
                "the jobs tables and manage.py runworker runs them."
            ),
            id="jobs.E050",
        )
    ]
