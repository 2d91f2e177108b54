"""Array parameters encoded once, in PostgreSQL's binary array format, by struct.

The worker's pass sends a dozen arrays (the outcomes' ids, tokens, states…, the claim's
names and limits). Given as lists, psycopg works out each list's element type and dumps
every element through its adapters on every statement, on a new cursor each pass, so
nothing of that is kept: about 90 µs of the control thread's CPU a pass of 10 jobs, a tenth
of a one-process drain's worker CPU. :func:`array` encodes a list of a known PostgreSQL type
in one go; :func:`register` teaches a connection to send it as it is.

The encoding is ``array_send``'s: dimensions, a has-nulls flag, the element type, the
length and lower bound, then each element as a 4-byte length (-1 for NULL) and its binary
value. Only for the statements of :func:`jobs.queue._db.bound_cursor`, which bind their
parameters in binary (``%(name)b``). Text goes as UTF-8, the client encoding Django sets on
every PostgreSQL connection.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from functools import lru_cache, partial
from typing import Any, ClassVar
from uuid import UUID

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

_HEADER = struct.Struct(">iiIii")  # dimensions, has nulls, element oid, length, lower bound
_EMPTY = struct.Struct(">iiI")  # an empty array has no dimensions
_NULL = b"\xff\xff\xff\xff"
_INT8 = struct.Struct(">iq")  # each element: its length, then its value
_INT4 = struct.Struct(">ii")
_FLOAT8 = struct.Struct(">id")
_LENGTH = struct.Struct(">i")
_UUID_LENGTH = _LENGTH.pack(16)
_TRUE, _FALSE = _LENGTH.pack(1) + b"\x01", _LENGTH.pack(1) + b"\x00"
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)  # PostgreSQL's timestamps count from here
_MICROSECOND = timedelta(microseconds=1)


def _text(value: str) -> bytes:
    if len(value) <= 64:
        return _short_text(value)
    data = value.encode()
    return _LENGTH.pack(len(data)) + data


@lru_cache(maxsize=1024)  # states, names, codes: the same few short strings every pass
def _short_text(value: str) -> bytes:
    data = value.encode()
    return _LENGTH.pack(len(data)) + data


def _jsonb(value: str) -> bytes:  # JSON text, already encoded (jobs.queue.text.dumps)
    data = value.encode()
    return _LENGTH.pack(len(data) + 1) + b"\x01" + data  # jsonb's binary format: version 1


def _uuid(value: UUID) -> bytes:
    return _UUID_LENGTH + value.bytes


def _timestamptz(value: datetime) -> bytes:  # aware: microseconds since 2000-01-01 UTC
    return _INT8.pack(8, (value - _EPOCH) // _MICROSECOND)


# name: (element oid, array oid, one element's length and value)
_KINDS: dict[str, tuple[int, int, Callable[[Any], bytes]]] = {
    "bigint": (20, 1016, partial(_INT8.pack, 8)),
    "integer": (23, 1007, partial(_INT4.pack, 4)),
    "float8": (701, 1022, partial(_FLOAT8.pack, 8)),
    "boolean": (16, 1000, lambda value: _TRUE if value else _FALSE),
    "text": (25, 1009, _text),
    "uuid": (2950, 2951, _uuid),
    "timestamptz": (1184, 1185, _timestamptz),
    "jsonb": (3802, 3807, _jsonb),
}


class Array:
    """A list encoded as a PostgreSQL array, ready to send as a parameter."""

    __slots__ = ("data",)
    oid: ClassVar[int]  # the array type's, one subclass each

    def __init__(self, data: bytes) -> None:
        self.data = data


class _ArrayDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: Array) -> bytes:
        return obj.data


def _kinds() -> tuple[dict[str, tuple[type[Array], int, Callable[[Any], bytes]]], list[Any]]:
    """For each kind: its Array class, its element's oid and encoder; and their dumpers."""
    classes, dumpers = {}, []
    for kind, (element, oid, encode) in _KINDS.items():
        made = type(f"Array_{kind}", (Array,), {"__slots__": (), "oid": oid})
        classes[kind] = (made, element, encode)
        dumpers.append((made, type(f"Dumper_{kind}", (_ArrayDumper,), {"oid": oid})))
    return classes, dumpers


_CLASSES, _DUMPERS = _kinds()


def array(kind: str, values: Sequence[Any]) -> Array | list[Any]:
    """``values`` (None for NULL) as an array of ``kind``: one of ``bigint``, ``integer``,
    ``float8``, ``boolean``, ``text``, ``uuid``, ``timestamptz`` (aware datetimes) and
    ``jsonb`` (JSON text).

    A value this cannot encode (a token given as text, a number out of the type's range)
    leaves the list to psycopg, as before: PostgreSQL casts it or refuses it, as it did.
    """
    made, element, encode = _CLASSES[kind]
    if not values:
        return made(_EMPTY.pack(0, 0, element))
    # `None in values` would compare each UUID by its Python __eq__.
    nulls = any(value is None for value in values) if kind == "uuid" else None in values
    parts = [_HEADER.pack(1, nulls, element, len(values), 1)]
    try:
        if nulls:
            parts += [_NULL if value is None else encode(value) for value in values]
        else:
            parts += map(encode, values)
    except (struct.error, AttributeError, TypeError, ValueError, OverflowError):
        return list(values)
    return made(b"".join(parts))


_registered: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()


def register(connection: psycopg.Connection[Any]) -> None:
    """Let ``connection``'s cursors send :class:`Array` parameters (once a connection)."""
    if connection not in _registered:
        for made, dumper in _DUMPERS:
            connection.adapters.register_dumper(made, dumper)
        _registered.add(connection)
