"""Typed job payloads: a versioned name, typed fields, validation, and a strict JSON codec.

A payload is the contract between the code that enqueues a job and the handler that runs it,
so it is defined once, as a frozen dataclass that carries its persisted name::

    class SendEmailV1(Payload, name="email.send.v1"):
        email_id: int

The name never depends on field values, and it carries the version so that two versions of a
contract can be queued side by side while producers move from one to the other. Decoding is
strict (exactly one JSON object, no unknown fields, every value checked against its
annotation) because a stored payload that does not fit its type can never succeed: the worker
fails it at once as ``invalid_payload`` rather than retrying it.

Fields typed ``list[...]`` or ``dict[...]`` decode to (unhashable) lists and dicts; use
``tuple[X, ...]`` and nested dataclasses where a payload must be hashable.

Over 400 lines: the strict codec checks every annotation a field may have (scalars, dates,
UUIDs, decimals, enums, nested dataclasses, tuples, lists, dicts, unions) in one place.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, Union, dataclass_transform
from uuid import UUID

from django.core.exceptions import ValidationError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: Lowercase dotted segments ending in a version: ``email.send.v1``.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*\.v[1-9][0-9]*$")
NAME_MAX_LENGTH = 200  # the jobs table's name column
_RESERVED = frozenset({"job_name", "to_json", "from_json", "validate"})
_SCALARS: dict[type, str] = {
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    UUID: "a UUID string",
    datetime: "an ISO 8601 datetime with a UTC offset",
    date: "an ISO 8601 date",
    Decimal: "a decimal string",
}
_PARSERS: dict[type, Callable[[Any], Any]] = {
    UUID: UUID,
    datetime: datetime.fromisoformat,
    date: date.fromisoformat,
    Decimal: Decimal,
}


class InvalidPayload(ValueError):
    """A payload does not fit its type; ``path`` names the field (``items[2].qty``)."""

    def __init__(self, reason: str, path: str = "") -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


@dataclass_transform(kw_only_default=True, frozen_default=True)
class Payload:
    """Base class of typed payloads; subclasses become frozen, keyword-only dataclasses."""

    job_name: ClassVar[str]
    if TYPE_CHECKING:
        # Every subclass is a dataclass (__init_subclass__), so dataclasses.fields() takes it.
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            raise TypeError(
                f"{cls.__qualname__} must declare its versioned name: "
                f"class {cls.__name__}(Payload, name='email.send.v1')"
            )
        if (
            not isinstance(name, str)
            or len(name) > NAME_MAX_LENGTH
            or not NAME_PATTERN.fullmatch(name)
        ):
            raise TypeError(
                f"{cls.__qualname__}: invalid job name {name!r}; use lowercase dotted segments "
                f"ending in a version, e.g. 'email.send.v1' (at most {NAME_MAX_LENGTH} characters)"
            )
        cls.job_name = name
        dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        clashes = sorted(f.name for f in dataclasses.fields(cls) if f.name in _RESERVED)
        if clashes:
            raise TypeError(f"{cls.__qualname__}: field names {clashes} are reserved by Payload")

    def validate(self) -> None:
        """Check rules the field types cannot express; raise ValueError or ValidationError."""

    def to_json(self) -> dict[str, Any]:
        """The payload as a JSON-compatible dict (what the jobs table stores)."""
        return _encode_fields(self, "")

    @classmethod
    def from_json(cls, data: object) -> Self:
        """Decode exactly one JSON object (a dict, or str/bytes holding one) and validate it."""
        if isinstance(data, str | bytes | bytearray):
            data = _parse(data)
        # The stored object of a plain payload (see checked_json) holds exactly its fields,
        # each of its type: built from it at once, not decoded field by field (a worker
        # decodes every job it runs; the full way cost five times building the payload).
        plain = _plain_fields(typing.cast(type, cls))
        if plain is not None and type(data) is dict and len(data) == len(plain):
            for name, tp in plain:
                if not _exactly(data.get(name, _MISSING), tp):
                    break
            else:
                return cls(**data)
        return _decode_dataclass(cls, data, "")


_MISSING = object()


def _exactly(value: object, tp: type) -> bool:
    """Whether ``value`` is of the plain type ``tp`` itself (a finite one, for float): what
    the full decoding takes as it is (see :func:`_plain_fields`)."""
    return type(value) is tp and (tp is not float or math.isfinite(typing.cast(float, value)))


def checked_json(payload: Payload) -> dict[str, Any]:
    """``payload.to_json()``, once ``from_json`` has taken it back (else InvalidPayload).

    The producer's check that a worker can decode what it stores. A payload whose fields
    are all ``str``, ``int``, ``bool`` or ``float`` and hold exactly such values (a finite
    float) decodes to an equal payload by construction when its class adds no
    ``validate``, ``__post_init__`` or codec of its own: its fields are read as they are,
    without building a second payload (a third of a bulk enqueue's client time).
    """
    cls: type[Payload] = type(payload)
    plain = _plain_fields(typing.cast(type, cls))
    if plain is not None:
        data = {}
        for name, tp in plain:
            value = getattr(payload, name)
            if not _exactly(value, tp):
                break
            data[name] = value
        else:
            return data
    data = payload.to_json()
    cls.from_json(data)
    return data


@cache
def _plain_fields(cls: type) -> tuple[tuple[str, type], ...] | None:
    """The ``(name, type)`` of each field when all are plain scalars and the class decodes
    them as Payload does; None when a payload of ``cls`` takes the full round trip."""
    if (
        _validates(cls)
        or hasattr(cls, "__post_init__")
        or getattr(cls, "to_json", None) is not Payload.to_json
        or getattr(cls.from_json, "__func__", None) is not Payload.from_json.__func__  # type: ignore[attr-defined]
    ):
        return None
    try:
        hints = _hints(cls)
    except NameError:
        return None  # from_json reports it
    fields = tuple((name, hints[name]) for name in _init_fields(cls))
    if all(tp in (str, int, bool, float) for _, tp in fields):
        return fields
    return None


def payload_problems(cls: type) -> list[str]:
    """Why ``cls`` cannot serve as a job payload type (empty when it can)."""
    if not isinstance(cls, type) or not issubclass(cls, Payload) or cls is Payload:
        return [f"{cls!r} is not a subclass of jobs.Payload"]
    problems: list[str] = []
    _check_dataclass(cls, "", problems, set())
    return problems


# -- encoding -------------------------------------------------------------------------------


# Values JSON holds as they are: checked by type alone first, the commonest case.
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _encode_fields(value: DataclassInstance, path: str) -> dict[str, Any]:
    """A dataclass instance's fields, encoded (a plain value as it is, without a call)."""
    out = {}
    for name in _init_fields(type(value)):
        item = getattr(value, name)
        out[name] = item if type(item) in _PLAIN else _encode(item, _join(path, name))
    return out


def _encode(value: Any, path: str) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum are both
        return _encode(value.value, path)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, UUID | Decimal):
        return str(value)
    if isinstance(value, date):  # datetime too
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_fields(value, path)
    if isinstance(value, list | tuple):
        return [_encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidPayload(f"object keys must be str, got {_kind(key)}", path)
            out[key] = _encode(item, _key(path, key))
        return out
    raise InvalidPayload(f"cannot encode {_kind(value)} as JSON", path)


# -- decoding -------------------------------------------------------------------------------


def _parse(text: str | bytes | bytearray) -> object:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(token: str) -> Any:
        raise ValueError(f"{token} is not allowed")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise InvalidPayload(f"invalid JSON: {exc}") from None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# A dataclass's fields are fixed once the class exists; reading them anew for every payload
# cost a tenth of a bulk enqueue's client time.
@cache
def _init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields ``__init__`` takes, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


@cache
def _required_fields(cls: type) -> tuple[str, ...]:
    """The fields ``__init__`` takes that have no default."""
    return tuple(
        name
        for name, f in _init_fields(cls).items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def _decode_dataclass[T: DataclassInstance](cls: type[T], data: object, path: str) -> T:
    if not isinstance(data, dict):
        raise InvalidPayload(f"expected a JSON object, got {_kind(data)}", path)
    fields = _init_fields(cls)
    if not fields.keys() >= data.keys():
        unknown = sorted(str(key) for key in data if key not in fields)
        raise InvalidPayload(f"unknown field{'s' * (len(unknown) > 1)} {_names(unknown)}", path)
    missing = [name for name in _required_fields(cls) if name not in data]
    if missing:
        raise InvalidPayload(
            f"missing required field{'s' * (len(missing) > 1)} {_names(missing)}", path
        )
    try:
        decoders = _field_decoders(cls)
    except NameError as exc:
        raise TypeError(f"{cls.__qualname__}: cannot resolve field types: {exc}") from exc
    values = {name: decoders[name](value, _join(path, name)) for name, value in data.items()}
    try:
        instance = cls(**values)
        if _validates(cls) and callable(validate := getattr(instance, "validate", None)):
            validate()
    except InvalidPayload as exc:
        raise InvalidPayload(exc.reason, _join(path, exc.path)) from None
    except ValidationError as exc:
        raise InvalidPayload("; ".join(exc.messages), path) from None
    except ValueError as exc:
        raise InvalidPayload(str(exc) or type(exc).__name__, path) from None
    return instance


@cache
def _field_decoders(cls: type) -> dict[str, Callable[[object, str], Any]]:
    """Each field's decoder, by name: the field types are read once a class, not once a
    payload (a worker decodes every job it runs, a producer every job it enqueues)."""
    hints = _hints(cls)
    return {name: _decoder(hints[name]) for name in _init_fields(cls)}


@cache
def _validates(cls: type) -> bool:
    """Whether the class may define ``validate`` (anything but Payload's own, which does
    nothing): the call is skipped when it cannot."""
    return getattr(cls, "validate", None) is not Payload.validate


def _decoder(tp: Any) -> Callable[[object, str], Any]:
    """A decoder for values of ``tp``: what :func:`_decode` does, with a shortcut for the
    scalars JSON gives as they are (a value of another type takes the checked path)."""
    if tp in (str, int, bool):

        def exact(value: object, path: str) -> Any:
            return value if type(value) is tp else _decode_scalar(tp, value, path)

        return exact
    if tp is float:

        def finite(value: object, path: str) -> Any:
            if type(value) is float and math.isfinite(value):
                return value
            return _decode_scalar(float, value, path)

        return finite
    return lambda value, path: _decode(tp, value, path)


def _decode(tp: Any, value: object, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [arm for arm in args if arm is not type(None)]
        for arm in arms[:-1]:  # the first arm that fits wins; the last one reports
            try:
                return _decode(arm, value, path)
            except InvalidPayload:
                continue
        return _decode(arms[-1], value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and isinstance(value, tp):
        return value
    if origin is Literal or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        options = {arg: arg for arg in args} if origin is Literal else {m.value: m for m in tp}
        for option, result in options.items():
            if type(option) is type(value) and option == value:  # True is not 1 here
                return result
        raise InvalidPayload(f"expected one of {_names(options)}, got {_show(value)}", path)
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise InvalidPayload(f"expected a list, got {_kind(value)}", path)
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        if fixed and len(value) != len(args):
            raise InvalidPayload(f"expected {len(args)} items, got {len(value)}", path)
        arg_types = args if fixed else [args[0] if args else Any] * len(value)
        items = [
            _decode(arg, item, f"{path}[{i}]")
            for i, (arg, item) in enumerate(zip(arg_types, value, strict=True))
        ]
        return tuple(items) if tuple in (tp, origin) else items
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise InvalidPayload(f"expected an object, got {_kind(value)}", path)
        if not all(isinstance(key, str) for key in value):
            raise InvalidPayload("object keys must be strings", path)
        arg = args[1] if args else Any
        return {key: _decode(arg, item, _key(path, key)) for key, item in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, path)
    if tp in _SCALARS:
        return _decode_scalar(tp, value, path)
    raise TypeError(f"{path}: unsupported payload field type {tp!r}")


def _decode_scalar(tp: type, value: object, path: str) -> Any:
    mismatch = InvalidPayload(f"expected {_SCALARS[tp]}, got {_kind(value)}", path)
    if isinstance(value, bool) != (tp is bool):  # JSON true/false is not a number
        raise mismatch
    if tp in (str, int, bool):
        if isinstance(value, tp):
            return value
        raise mismatch
    if tp is float:
        if not isinstance(value, int | float):
            raise mismatch
        try:
            number = float(value)
        except OverflowError:
            raise InvalidPayload("number out of range", path) from None
        if not math.isfinite(number):
            raise InvalidPayload("expected a finite number", path)
        return number
    if isinstance(value, tp) and not (tp is date and isinstance(value, datetime)):
        result: Any = value
    elif isinstance(value, str) or (tp is Decimal and isinstance(value, int)):
        try:
            result = _PARSERS[tp](value)
        except (ValueError, TypeError, InvalidOperation):
            raise InvalidPayload(f"expected {_SCALARS[tp]}, got {_show(value)}", path) from None
    else:
        raise mismatch
    if tp is datetime and not _aware(result):
        raise InvalidPayload(f"expected {_SCALARS[tp]}, got {_show(value)}", path)
    if tp is Decimal and not result.is_finite():
        raise InvalidPayload(f"expected a finite decimal, got {_show(value)}", path)
    return result


# -- schema check (run when the registry is built) --------------------------------------------


def _check_dataclass(cls: type, path: str, problems: list[str], seen: set[type]) -> None:
    if cls in seen:
        return
    seen.add(cls)
    try:
        hints = _hints(cls)
    except Exception as exc:  # NameError, TypeError: an annotation that does not resolve
        problems.append(f"{cls.__qualname__}: cannot resolve field types: {exc}")
        return
    for f in dataclasses.fields(cls):
        _check_type(hints[f.name], _join(path, f.name), problems, seen, cls)


def _check_type(tp: Any, path: str, problems: list[str], seen: set[type], owner: type) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType, list, tuple, dict):
        if origin is dict and args and args[0] is not str:
            problems.append(f"{owner.__qualname__}.{path}: object keys must be str in JSON")
        for arg in args[1:] if origin is dict else args:
            if arg is not Ellipsis and arg is not type(None):
                _check_type(arg, path, problems, seen, owner)
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        _check_dataclass(tp, path, problems, seen)
    elif not (
        tp in (Any, object, list, tuple, dict, *_SCALARS)
        or origin is Literal
        or (isinstance(tp, type) and issubclass(tp, enum.Enum))
    ):
        problems.append(f"{owner.__qualname__}.{path}: unsupported field type {_describe(tp)}")


# -- messages -------------------------------------------------------------------------------


def _aware(value: datetime) -> bool:
    return value.tzinfo is not None and value.utcoffset() is not None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


def _key(path: str, key: str) -> str:
    return f"{path}[{json.dumps(key)}]"


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _names(items: Any) -> str:
    return ", ".join(repr(item) for item in items)


def _describe(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "")
