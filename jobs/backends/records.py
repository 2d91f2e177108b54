"""A ``django.tasks`` task as a job row: its payload, the JSON it stores, and the row read back.

Enqueue turns a task's call into a :class:`DjangoTaskV1` payload whose arguments are the JSON
the jobs table stores (:func:`to_json` refuses, by name, what it would not store or read back
the same). ``get_result()`` reads a row back without importing the task (:func:`stored_task`),
and reports each failed attempt as Django's ``TaskError``, the exception class read from the
traceback the worker stored (:func:`errors`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.tasks import Task
from django.tasks.base import TaskError
from django.utils import timezone
from django.utils.module_loading import import_string

from jobs.catalogue.payloads import InvalidPayload, Payload

if TYPE_CHECKING:
    from jobs.queue.attempts import Attempt

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


def class_path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


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
        f"{where}: {class_path(type(value)).removeprefix('builtins.')} is not a JSON type"
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


def stored_payload(data: Any) -> DjangoTaskV1:
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


def stored_task(path: str, **fields: Any) -> Task[..., Any]:
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


def errors(job: Any, listed: Sequence[Attempt]) -> list[TaskError]:
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


def worker_ids(job: Any, listed: Sequence[Attempt]) -> list[str]:
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
