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

# _ENCODER's own C encoding function, made once: JSONEncoder.encode makes it again on every
# call, so a small payload took 1.15 µs to encode instead of 0.3. Made without the dict
# that finds cycles, it keeps no state between calls, so threads can share it; a value it
# fails on (a cycle recurses until RecursionError) is encoded again by _ENCODER, whose error
# is the one raised.
_C_MAKE_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # None without CPython's _json
_ENCODE = (
    _C_MAKE_ENCODER(
        None,  # markers: no dict of the containers open, no cycle check
        _ENCODER.default,
        json.encoder.encode_basestring,  # what ensure_ascii=False writes strings with
        None,  # indent
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        _ENCODER.sort_keys,
        _ENCODER.skipkeys,
        _ENCODER.allow_nan,
    )
    if _C_MAKE_ENCODER is not None
    else None
)


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
    """``_ENCODER.encode(value)``, by the encoding function made once where there is one."""
    if _ENCODE is None or type(value) is str:
        return _ENCODER.encode(value)
    try:
        return "".join(_ENCODE(value, 0))
    except Exception:
        return _ENCODER.encode(value)  # raises as it always did


def check_json_text(text: str) -> str | None:
    """Why ``jsonb`` would refuse this ``json.dumps(ensure_ascii=False)`` output, or None."""
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        return "a string contains a NUL character (\\u0000)"
    if not text.isascii() and _SURROGATE.search(text):
        return "a string contains a lone surrogate (not valid UTF-8)"
    return None


def _locate(value: Any, path: str = "$") -> str:
    """The path of the first string (key or value) the database would refuse."""
    if isinstance(value, str):
        return path if problem(value) else ""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and problem(key):
                return f"key {key!r} of {path}"
            found = _locate(item, f"{path}.{key}")
            if found:
                return found
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _locate(item, f"{path}[{index}]")
            if found:
                return found
    return ""
