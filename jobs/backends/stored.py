"""What a ``django.task.v1`` job stores: the task's path and arguments, as strict JSON.

Read back without importing the task, so a job stays readable after its task is removed.
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
from django.utils import timezone
from django.utils.module_loading import import_string

from jobs.catalogue.payloads import InvalidPayload, Payload

if TYPE_CHECKING:
    pass


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


def class_path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"
