"""Encodings as they were, for property tests that hold the current encoding to them."""

from __future__ import annotations

import math

from jobs.queue import text


def encoded_as_before(value: object) -> str:
    """``text.dumps`` as it was, encoding by ``JSONEncoder.encode`` on every call."""
    kind = type(value)
    try:
        if kind is int or (kind is float and math.isfinite(value)):
            return repr(value)
        encoded = text._ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None
    bad = text.check_json_text(encoded)
    if bad:
        raise ValueError(f"{bad}: {text._locate(value)}")
    return encoded
