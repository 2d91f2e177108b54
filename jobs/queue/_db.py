"""Small helpers the queue modules share: cursors, parameters, and decoding rows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.backends.utils import CursorWrapper
from psycopg.pq import Format

if TYPE_CHECKING:
    from psycopg.abc import Params, QueryNoTemplate

_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


@contextmanager
def cursor(using: str | None) -> Iterator[CursorWrapper]:
    """A cursor on the caller's connection, so every call joins the caller's transaction."""
    with connections[using or DEFAULT_DB_ALIAS].cursor() as cur:
        yield cur


class _BoundCursor(psycopg.Cursor):
    """Server-side binding, never prepared: a pooler in transaction mode keeps no statements."""

    def execute(  # type: ignore[override]  # one signature for both of psycopg's overloads
        self,
        query: QueryNoTemplate,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        return super().execute(query, params, prepare=False, binary=binary)


@contextmanager
def bound_cursor(using: str | None) -> Iterator[CursorWrapper]:
    """Like :func:`cursor`, with the parameters sent apart from the SQL text.

    Django's cursors quote every parameter into the SQL text in Python, element by element
    for the arrays of a batch statement. With ``%(name)b`` placeholders the arrays travel in
    binary instead: inserting 10,000 jobs took 2.7 µs of client CPU and 15 µs of wall time a
    job instead of 8.3 and 22. Same connection, same transaction, and the same Django
    wrappers (query logging, ``execute_wrapper``).
    """
    conn = connections[using or DEFAULT_DB_ALIAS]
    conn.close_if_health_check_failed()
    conn.ensure_connection()
    with conn.wrap_database_errors:
        raw = _BoundCursor(conn.connection)
        # As Django's own cursors do: timestamps in the connection's time zone.
        loader = conn.connection.adapters.get_loader(_TIMESTAMPTZ, Format.TEXT)
        if conn.timezone != getattr(loader, "timezone", None):
            register_tzloader(conn.timezone, raw)
    conn.validate_thread_sharing()
    make = conn.make_debug_cursor if conn.queries_logged else conn.make_cursor
    wrapped = make(raw)  # type: ignore[arg-type]  # (the stubs expect a wrapper here)
    with wrapped as cur:
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
