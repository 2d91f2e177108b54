"""Small helpers the queue modules share: cursors, parameters, and decoding rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.utils import CursorWrapper


@contextmanager
def cursor(using: str | None) -> Iterator[CursorWrapper]:
    """A cursor on the caller's connection, so every call joins the caller's transaction."""
    with connections[using or DEFAULT_DB_ALIAS].cursor() as cur:
        yield cur


def server_version(using: str | None) -> int:
    """The server's version number (180000 for 18.0), as Django's backend caches it."""
    version: int = connections[using or DEFAULT_DB_ALIAS].pg_version  # type: ignore[attr-defined]
    return version


def seconds(value: timedelta) -> float:
    return value.total_seconds()


def load_json(value: Any) -> Any:
    """Django's psycopg setup may hand jsonb back as text; accept either form."""
    if isinstance(value, str):
        return json.loads(value)
    return value


def load_json_or_text(value: Any) -> Any:
    """:func:`load_json`, or the text itself when Python cannot read it back.

    A payload another producer wrote may hold what Python's ``json`` refuses (a number over
    ``sys.get_int_max_str_digits()``); decoding the text later fails as ``invalid_payload``
    for that one job instead of failing the claim of every job with it.
    """
    try:
        return load_json(value)
    except ValueError:
        return value
