"""Text and JSON that PostgreSQL will store: no NUL characters, no lone surrogates.

PostgreSQL's ``text`` refuses NUL (``\\x00``) and ``jsonb`` refuses ``\\u0000``; both refuse
strings that are not valid UTF-8, which in Python means lone surrogates (``"\\ud800"``, as
``surrogateescape`` decoding produces). A refused value fails its whole statement, so
everything a caller or a handler hands to the queue passes through here first:

* :func:`problem` and :func:`check_json_text` find such values so enqueue can refuse them
  (``InvalidJob``) before any statement runs in the caller's transaction;
* :func:`clean` makes any text storable (error details, tracebacks) by escaping what the
  database would refuse, so an outcome is never lost to the text it carries;
* :func:`dumps` encodes a result strictly (no NaN or infinities, nothing the database would
  refuse), raising :class:`ValueError` with the place of the first bad value.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# A \u0000 escape in json.dumps output: a backslash preceded by an even number of backslashes
# (an escaped backslash is "\\", so an odd run means the "u0000" is literal text).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_SURROGATE = re.compile("[\ud800-\udfff]")


def problem(value: str) -> str | None:
    """Why PostgreSQL would refuse this string, or None when it is storable."""
    if "\x00" in value:
        return "contains a NUL character (\\x00)"
    if not value.isascii() and _SURROGATE.search(value):
        return "contains a lone surrogate (not valid UTF-8)"
    return None


def clean(value: str) -> str:
    """The string with NUL characters and lone surrogates escaped as visible text."""
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    if not value.isascii() and _SURROGATE.search(value):
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


# One encoder for every call: json.dumps builds a new one whenever an option is given.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

# _ENCODER's own C encoding function, made once a thread: JSONEncoder.encode makes it again
# on every call, so dumps() of a small payload took 1.15 µs instead of 0.56. It is the function
# encode() would make, with its dict of the containers being written (how it finds a cycle),
# so it writes and refuses exactly as encode() does. That dict is its state: one a thread,
# and one made anew after a refusal, which may leave entries behind.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # None without CPython's _json
_encoders = threading.local()


def _new_encoding_function() -> Callable[[Any, int], Sequence[str]]:
    assert _C_MAKE_ENCODER is not None
    function: Callable[[Any, int], Sequence[str]] = _C_MAKE_ENCODER(
        {},  # markers: the containers open, to refuse a cycle
        _ENCODER.default,
        json.encoder.encode_basestring,  # what ensure_ascii=False writes strings with
        None,  # indent
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        _ENCODER.sort_keys,
        _ENCODER.skipkeys,
        _ENCODER.allow_nan,
    )
    return function


def dumps(value: Any) -> str:
    """Encode ``value`` as JSON that ``jsonb`` accepts, or raise ValueError saying why."""
    kind = type(value)
    try:
        if kind is int or (kind is float and math.isfinite(value)):  # a common result
            return repr(value)  # as the encoder writes them (the exact types: no override)
        text = _encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None
    bad = check_json_text(text)
    if bad:
        raise ValueError(f"{bad}: {_locate(value)}")
    return text


def _encode(value: Any) -> str:
    """``_ENCODER.encode(value)``, by this thread's encoding function where there is one."""
    if _C_MAKE_ENCODER is None or isinstance(value, str):
        return _ENCODER.encode(value)
    try:
        encode = _encoders.function
    except AttributeError:
        encode = _encoders.function = _new_encoding_function()
    try:
        return "".join(encode(value, 0))
    except BaseException:
        del _encoders.function  # its dict of open containers may keep this value's
        raise


def check_json_text(text: str) -> str | None:
    """Why ``jsonb`` would refuse this ``json.dumps(ensure_ascii=False)`` output, or None."""
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        return "a string contains a NUL character (\\u0000)"
    if not text.isascii() and _SURROGATE.search(text):
        return "a string contains a lone surrogate (not valid UTF-8)"
    return None


def _locate(value: Any, path: str = "$") -> str:
    """The path of the first string (key or value) the database would refuse, in the order
    the text is written. A loop, not recursion: the encoder writes values nested deeper
    than Python's recursion limit."""
    pending: list[Iterator[tuple[str, Any]]] = [iter([(path, value)])]
    while pending:
        for at, item in pending[-1]:
            if item is _REFUSED_KEY or (isinstance(item, str) and problem(item)):
                return at
            if isinstance(item, dict):
                pending.append(_entries(item, at))
                break
            if isinstance(item, list | tuple):
                pending.append(_elements(item, at))
                break
        else:
            pending.pop()
    return ""


_REFUSED_KEY = object()


def _elements(sequence: list[Any] | tuple[Any, ...], path: str) -> Iterator[tuple[str, Any]]:
    for index, item in enumerate(sequence):
        yield f"{path}[{index}]", item


def _entries(mapping: dict[Any, Any], path: str) -> Iterator[tuple[str, Any]]:
    """A mapping's entries for :func:`_locate`: a key the database would refuse comes as
    ``_REFUSED_KEY`` at its own path, before its value."""
    for key, item in mapping.items():
        if isinstance(key, str) and problem(key):
            yield f"key {key!r} of {path}", _REFUSED_KEY
        yield f"{path}.{key}", item
