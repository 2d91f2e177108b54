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
docs/tasks.md has the table of every case and what ``get_result()`` then reports.

OPTIONS (all optional): ``DATABASE`` (alias, default ``JOBS["DATABASE"]``), ``MAX_ATTEMPTS``
(default ``JOBS["DEFAULT_MAX_ATTEMPTS"]``), ``CONCURRENCY`` (tasks run at once per worker,
default: as many as the worker's ``--concurrency``) and ``TIMEOUT`` (seconds, default 300).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from traceback import format_exception
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TASK_REFRESH_ATTRS, TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.module_loading import import_string

from jobs.catalogue.payloads import InvalidPayload, Payload
from jobs.catalogue.policy import Policy
from jobs.core.conf import jobs_settings
from jobs.core.context import JobContext
from jobs.core.limits import validate_key
from jobs.core.progress import Progress
from jobs.core.progress import read as read_progress
from jobs.errors import Reject, fail_now

if TYPE_CHECKING:
    from jobs.queue.attempts import Attempt

_STATUS = {
    "queued": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}
# The exception line of a formatted traceback: "pkg.mod.Error: message" or "KeyError"; a
# class defined in a function has "<locals>" in its path.
_EXCEPTION_LINE = re.compile(r"^(?P<path>[A-Za-z_][\w.<>]*)(?::|$)")
_SURROGATE = re.compile("[\ud800-\udfff]")


class DjangoTaskV1(Payload, name="django.task.v1"):
    """A call of a ``@task`` function: its import path and JSON arguments.

    ``run_after`` is the task's own, as enqueued: the job row's ``run_after`` is when the
    next attempt is due, which a retry moves. Left out of the stored object when None, so a
    worker of a version without the field still runs the tasks enqueued without one.
    """

    path: str
    args: list[Any]
    kwargs: dict[str, Any]
    takes_context: bool = False
    backend: str = "default"
    run_after: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if data.get("run_after") is None:
            del data["run_after"]
        return data


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
        payload = _stored_payload(job.payload)
        task = _stored_task(
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
            errors=_errors(job, listed),
            worker_ids=_worker_ids(job, listed),
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
                f"{payload.path} raised {_class_path(type(exc))}, which is not an Exception: "
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
        raise Reject(f"TASKS[{alias!r}] is {_class_path(type(backend))}, not {BACKEND_PATH}")
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
        exception_class_path=_class_path(type(exc)), traceback="".join(format_exception(exc))
    )


def _class_path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


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


def to_json(value: Any, where: str) -> Any:
    """``value`` as the JSON the jobs table stores and reads back, or an error naming ``where``.

    Django's ``normalize_json`` first (mappings, sequences, UTF-8 bytes; a ``TypeError`` for
    other types), then what ``jsonb`` and ``json.dumps`` would do or refuse: non-string keys
    become strings as ``json.dumps`` writes them, and NaN, infinities, NUL characters and
    lone surrogates raise ``ValueError``, so the problem surfaces here, named, instead of as
    a database error.
    """
    return _json(value, where, set())


def _json(value: Any, where: str, open_: set[int]) -> Any:
    match value:
        case str():
            _check_text(value, where)
            return value
        case bool() | int() | None:
            return value
        case float():
            if not math.isfinite(value):
                raise ValueError(f"{where}: {value!r} is not a JSON number")
            return value
        case bytes():
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: bytes that are not UTF-8") from None
            _check_text(text, where)
            return text
        case Mapping() | Sequence():
            if id(value) in open_:
                raise ValueError(f"{where}: a container that contains itself")
            open_.add(id(value))
            try:
                if isinstance(value, Mapping):
                    return {
                        _json_key(key, where): _json(item, f"{where}[{key!r}]", open_)
                        for key, item in value.items()
                    }
                return [_json(item, f"{where}[{i}]", open_) for i, item in enumerate(value)]
            finally:
                open_.discard(id(value))
    raise TypeError(
        f"{where}: {_class_path(type(value)).removeprefix('builtins.')} is not a JSON type"
    )


def _json_key(key: object, where: str) -> str:
    """A mapping key as ``json.dumps`` writes it (``1`` → ``"1"``, ``None`` → ``"null"``)."""
    if isinstance(key, bytes):
        key = _json(key, f"{where} (a key)", set())
    if isinstance(key, float) and not math.isfinite(key):
        raise ValueError(f"{where}: the key {key!r} is not a JSON number")
    if isinstance(key, str):
        _check_text(key, f"{where} (a key)")
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    raise TypeError(f"{where}: a key of type {type(key).__qualname__} (JSON keys are strings)")


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise ValueError(f"{where}: a NUL character (\\x00), which PostgreSQL cannot store")
    if _SURROGATE.search(text):
        raise ValueError(f"{where}: a lone surrogate, which is not valid UTF-8")


def _stored_payload(data: Any) -> DjangoTaskV1:
    """The job's payload; one that does not decode (the worker fails it as
    ``invalid_payload``) is read field by field, so its result can still be shown."""
    try:
        return DjangoTaskV1.from_json(data)
    except InvalidPayload:
        data = data if isinstance(data, dict) else {}

    def field(name: str, kind: type, default: Any) -> Any:
        value = data.get(name)
        return value if isinstance(value, kind) else default

    return DjangoTaskV1(
        path=field("path", str, ""),
        args=field("args", list, []),
        kwargs=field("kwargs", dict, {}),
        takes_context=field("takes_context", bool, False),
        backend=field("backend", str, "default"),
        run_after=_stored_time(data.get("run_after")),
    )


def _stored_time(value: Any) -> datetime | None:
    """An aware datetime written as ISO 8601, else None."""
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return when if when is not None and timezone.is_aware(when) else None


def _stored_task(path: str, **fields: Any) -> Task[..., Any]:
    """The ``Task`` a stored job names, found without importing anything.

    The function is the real one when its module is already loaded (as it is wherever the
    task was enqueued or run), else a stand-in that imports the task when called, so a
    result stays readable after its task was removed. Django's ``Task`` validates itself
    against the current settings; a stored record is built without that check, because
    queues or priorities allowed when it was enqueued may have changed since.
    """
    module_name, _, name = path.rpartition(".")
    found = getattr(sys.modules.get(module_name), name, None)
    func = found.func if isinstance(found, Task) else _stand_in(path, module_name, name)
    task = object.__new__(Task)
    for field in dataclasses.fields(Task):
        default = None if field.default is dataclasses.MISSING else field.default
        object.__setattr__(task, field.name, fields.get(field.name, default))
    object.__setattr__(task, "func", func)
    return task


def _stand_in(path: str, module_name: str, name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        task = import_string(path)
        if not isinstance(task, Task):
            raise ImportError(f"{path} is a {type(task).__qualname__}, not a django.tasks Task")
        return task.call(*args, **kwargs)

    stand_in.__module__, stand_in.__name__, stand_in.__qualname__ = module_name, name, name
    stand_in.__doc__ = f"Stands for the task {path}, which this process has not imported."
    return stand_in


# get_result's exception class when the job's error is not a traceback, by last_error (the
# codes of jobs.runs.ErrorCode, which this module does not import: it loads before the models).
_CODE_CLASSES = {
    "deadline_exceeded": "builtins.TimeoutError",
    "invalid_payload": "jobs.catalogue.payloads.InvalidPayload",
    "cancelled": "jobs.errors.Cancelled",
}
_TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAIN_SEPARATORS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# An exception group's header starts "  + "; the worker strips the detail's leading spaces.
_GROUP_HEADERS = (
    "  + Exception Group " + _TRACEBACK_HEADER,
    "+ Exception Group " + _TRACEBACK_HEADER,
)


def _errors(job: Any, listed: Sequence[Attempt]) -> list[TaskError]:
    """An error per failed attempt, oldest first (``listed``: :func:`jobs.queue.attempts.of`).

    The last attempt's error is the row's own detail, which also explains a retry that is
    waiting. A row whose attempts were not recorded (written before the attempt log, or by
    hand) reports its last error alone.
    """
    errors = [_task_error(a.code, a.error) for a in listed if a.code]
    if not errors and job.last_error:
        errors = [_task_error(job.last_error, job.error_detail or "")]
    return errors


def _task_error(code: str, detail: str) -> TaskError:
    """One error as Django's ``TaskError``: the exception class read from the traceback.

    Details that are not a traceback (a deadline, an expired lease, a cancellation) are
    reported as ``"<code>: <detail>"`` with a class chosen by ``_CODE_CLASSES``.
    """
    path = _raised_class(detail)
    if path is None:
        path = _CODE_CLASSES.get(code, "builtins.Exception")
        detail = f"{code}: {detail}" if detail else code
    return TaskError(exception_class_path=path, traceback=detail)


def _worker_ids(job: Any, listed: Sequence[Attempt]) -> list[str]:
    """The worker of each attempt, the running one included."""
    if not listed:  # attempts not recorded: the last worker, once per attempt
        return [job.claimed_by or "unknown"] * job.attempts
    return [a.worker or "unknown" for a in listed]


def _raised_class(detail: str) -> str | None:
    """The class of the exception a formatted traceback ends with; None if it is no traceback.

    Chained exceptions come first, each ended by a separator line; the last block's exception
    line is the first unindented line after its header (so a message quoting another
    traceback does not mislead), and the lines after it are the rest of its message and its
    notes. An exception group's lines carry a ``"  | "`` margin.
    """
    lines = detail.splitlines()
    last_block = max((i for i, line in enumerate(lines) if line in _CHAIN_SEPARATORS), default=-1)
    start = next(
        (
            i
            for i in range(last_block + 1, len(lines))
            if lines[i] == _TRACEBACK_HEADER or lines[i] in _GROUP_HEADERS
        ),
        None,
    )
    if start is None:
        return None
    margin = "" if lines[start] == _TRACEBACK_HEADER else "  | "
    for line in lines[start + 1 :]:
        if not line.startswith(margin):
            break
        line = line.removeprefix(margin)
        if line and not line[0].isspace():
            match = _EXCEPTION_LINE.match(line)
            if match is None:
                break
            found = match.group("path")
            # format_exception leaves out the module of builtins (and of __main__).
            return found if "." in found else f"builtins.{found}"
    return "builtins.Exception"  # cut short before the exception line (long details are)


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
