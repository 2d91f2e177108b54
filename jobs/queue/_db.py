"""Small helpers the queue modules share: cursors, parameters, and decoding rows."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import Any, Self
from weakref import WeakKeyDictionary

import psycopg
from django.db import DEFAULT_DB_ALIAS, ProgrammingError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from psycopg.pq import Format

from jobs.core.conf import jobs_settings
from jobs.queue import _arrays

_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid


@contextmanager
def cursor(using: str | None) -> Iterator[CursorWrapper]:
    """A cursor on the caller's connection, so every call joins the caller's transaction."""
    with connections[using or DEFAULT_DB_ALIAS].cursor() as cur:
        yield cur


class _BoundCursor(psycopg.Cursor):
    """Server-side binding, prepared when ``JOBS["PREPARED_STATEMENTS"]`` says so.

    Off by default, so nothing is prepared: a pooler in transaction mode keeps no prepared
    statements unless it is made to (PgBouncer 1.21+, ``max_prepared_statements``). The
    connection's ``prepare_threshold`` (the database's ``OPTIONS``) is the project's choice
    for its own statements and is not followed: a project that turns it on for its web
    pages must not have the worker's statements prepared behind a pooler by the way. On, a
    single enqueue costs the server 150 µs instead of 200, its statement parsed and planned
    once a connection.
    """

    # The time zone its timestamps load in (the connection's when it was made).
    timezone: Any = None

    def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        if prepare is None:
            prepare = bool(jobs_settings.PREPARED_STATEMENTS)
        conn = self.connection
        if not prepare or conn.prepare_threshold is not None:
            return super().execute(query, params, prepare=prepare, binary=binary)
        # psycopg prepares nothing on a connection whose threshold is None (Django's default,
        # and the worker's own connections), even when asked; so it is lifted for this one
        # statement, and the project's own statements keep the connection's choice.
        conn.prepare_threshold = _NEVER_BY_COUNT
        try:
            return super().execute(query, params, prepare=True, binary=binary)
        finally:
            conn.prepare_threshold = None


# A threshold no statement reaches by being run: only those asked to are prepared.
_NEVER_BY_COUNT = 2**62


#: A bound cursor whose last result has more rows than this is closed, not kept.
KEEP_ROWS = 1_000

# Each connection's idle bound cursor, taken by the next use: a new cursor looks up the
# adapter of each parameter's type again, which cost a single enqueue (14 parameters) about
# 20 µs of client CPU, a third of its Python.
_idle: WeakKeyDictionary[BaseDatabaseWrapper, _BoundCursor] = WeakKeyDictionary()


@contextmanager
def bound_cursor(using: str | None) -> Iterator[CursorWrapper]:
    """Like :func:`cursor`, with the parameters sent apart from the SQL text.

    Django's cursors quote every parameter into the SQL text in Python, element by element
    for the arrays of a batch statement. With ``%(name)b`` placeholders the arrays travel in
    binary instead: inserting 10,000 jobs took 2.7 µs of client CPU and 15 µs of wall time a
    job instead of 8.3 and 22. Same connection, same transaction, and the same Django
    wrappers (query logging, ``execute_wrapper``).

    The cursor is kept for the connection's next use unless the statement failed, its result
    was large (:data:`KEEP_ROWS`); a use inside another gets its own.
    """
    conn = connections[using or DEFAULT_DB_ALIAS]
    conn.close_if_health_check_failed()
    conn.ensure_connection()
    raw = _take_idle(conn)
    if raw is None:
        with conn.wrap_database_errors:
            _arrays.register(conn.connection)
            raw = _BoundCursor(conn.connection)
            # As Django's own cursors do: timestamps in the connection's time zone.
            raw.timezone = conn.timezone
            loader = conn.connection.adapters.get_loader(_TIMESTAMPTZ, Format.TEXT)
            if conn.timezone != getattr(loader, "timezone", None):
                register_tzloader(conn.timezone, raw)
    conn.validate_thread_sharing()
    make = conn.make_debug_cursor if conn.queries_logged else conn.make_cursor
    wrapped = make(raw)  # type: ignore[arg-type]  # (the stubs expect a wrapper here)
    try:
        yield wrapped
    except BaseException as exc:
        _close(raw)
        refused = _refused(exc)
        stale = refused or _stale_plan(exc)
        if stale and conn.get_autocommit() and not conn.in_atomic_block:
            # psycopg would run the same prepared statement on every later call; the next
            # use connects afresh instead (in a transaction, the rollback forgets them).
            conn.close()
        if refused:
            raise PreparedStatementsRefused(
                f"{refused}. The queue prepares its statements because "
                'JOBS["PREPARED_STATEMENTS"] is on, and this connection goes through a pooler '
                "that does not keep them. Turn the setting off, or have the pooler keep them "
                "(PgBouncer 1.21 or later with max_prepared_statements above 0)."
            ) from exc
        raise
    result = raw.pgresult
    if (result is None or result.ntuples <= KEEP_ROWS) and conn not in _idle and _released(raw):
        _idle[conn] = raw
    else:
        _close(raw)


class PreparedStatementsRefused(ProgrammingError):
    """The server does not know a statement psycopg prepared on this connection: a pooler
    lent the call another server connection (or one already holding the name)."""


def _refused(exc: BaseException) -> psycopg.Error | None:
    """The error, when the server refused a prepared statement's name: missing on this
    server connection, or already taken there."""
    cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else exc
    refusals = (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)
    return cause if isinstance(cause, refusals) else None


def _stale_plan(exc: BaseException) -> bool:
    """Whether PostgreSQL refused a prepared statement because a schema change altered what
    it returns ("cached plan must not change result type")."""
    cause = exc.__cause__ if isinstance(exc.__cause__, psycopg.Error) else exc
    return (
        isinstance(cause, psycopg.errors.FeatureNotSupported)
        and cause.diag.source_function == "RevalidateCachedQuery"
    )


def _take_idle(conn: BaseDatabaseWrapper) -> _BoundCursor | None:
    """The connection's idle bound cursor, if it has one it can use (none for a new
    connection, or after its time zone changed)."""
    raw = _idle.pop(conn, None)
    if raw is None:
        return None
    if raw.closed or raw.connection is not conn.connection or raw.timezone != conn.timezone:
        _close(raw)
        return None
    return raw


def _released(raw: _BoundCursor) -> bool:
    """Drop the last statement's parameters and results from ``raw``, as its close would (a
    kept cursor must not hold a large payload until the connection's next use); False when
    this psycopg cannot, and the cursor is closed instead.

    psycopg offers no public call for it short of ``close()``: these are the steps close
    takes first (``tests/integration/queue/test_bound_cursor.py`` holds them to it).
    """
    try:
        raw._reset()
        raw._tx.set_pgresult(None)
    except (AttributeError, TypeError):
        return False
    return True


def _close(raw: _BoundCursor) -> None:
    with suppress(Exception):  # as Django's cursors close: a failing close is not news
        raw.close()


def copy_rows(
    cur: CursorWrapper, sql: str, types: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    """Run ``COPY … FROM STDIN (FORMAT BINARY)`` with ``rows`` on the cursor's connection.

    Rows stream to the server while they are written, and each column is sent in binary as
    ``types`` names it (:data:`JSONB_AS_TEXT` for a ``jsonb`` column). The COPY goes
    through Django's execute wrappers and query log as a statement does.
    """
    raw = cur.cursor

    def run(sql: str, params: Any, many: bool, context: dict[str, Any]) -> None:
        cur.db.validate_no_broken_transaction()
        with cur.db.wrap_database_errors, raw.copy(sql) as copy:
            copy.set_types(list(types))
            write_row = copy.write_row
            for row in rows:
                write_row(row)

    logged = cur.debug_sql(sql) if isinstance(cur, CursorDebugWrapper) else nullcontext()
    with logged:
        cur._execute_with_wrappers(sql, None, False, run)


#: How :func:`copy_rows` takes a ``jsonb`` column: name this type, and give each value as
#: ``JSONB_VERSION + text``, jsonb's binary form. COPY reads a field by its column's type,
#: whatever the client names; named ``text``, the string goes as UTF-8 through psycopg's C
#: adapter, instead of through its JSON adapter, two Python calls a row.
JSONB_AS_TEXT = "text"
JSONB_VERSION = "\x01"


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
