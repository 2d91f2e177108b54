"""A quicker flush after each transactional test: the same tables, for a fraction of the work.

pytest-django ends a test marked ``django_db(transaction=True)`` as Django's
``TransactionTestCase`` does: ``flush`` truncates every table of every installed app (33 of
them), then the ``post_migrate`` signal writes the content types and permissions again. That
took about 0.3 s a test, a fifth of the suite's time, while a test leaves rows in a handful of
tables. :func:`install` makes the flush truncate only what needs it:

- the tables written since they were last truncated, with ``CASCADE`` (a table whose foreign
  key points at one of them is emptied with it, as the full flush empties it);
- not the content types and permissions while they are exactly the rows ``post_migrate`` wrote
  after the last flush (a fingerprint of both tables says so). ``post_migrate`` still runs and,
  finding them all, writes nothing. A test that changed them gets them truncated and written
  afresh, as before.

Every table ends as the full flush leaves it, so what a test sees at its start is unchanged.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.db import connections
from django.db.backends.postgresql.operations import DatabaseOperations
from django.db.models.signals import post_migrate

#: Written by ``post_migrate``; kept across flushes while unchanged.
REFERENCE_TABLES = ("django_content_type", "auth_permission")

_FINGERPRINT = ", ".join(
    f"(SELECT md5(coalesce(string_agg(t::text, ',' ORDER BY t.id), '')) FROM {table} t)"
    for table in REFERENCE_TABLES
)

_full_sql_flush = DatabaseOperations.sql_flush
#: By database alias: the fingerprint of the reference tables as the last flush left them.
_left: dict[str, tuple[str, ...]] = {}


def install() -> None:
    """Make every flush on PostgreSQL (the test suite's only backend) the quicker one."""
    DatabaseOperations.sql_flush = _sql_flush  # type: ignore[method-assign]
    # post_migrate is sent once for each app with models, in order: after the last one, the
    # content types and permissions are all written (by migrate, or after a flush).
    last = [config for config in apps.get_app_configs() if config.models_module is not None][-1]
    post_migrate.connect(_remember, sender=last, dispatch_uid=__name__)


def _sql_flush(
    self: DatabaseOperations,
    style: Any,
    tables: list[str],
    *,
    reset_sequences: bool = False,
    allow_cascade: bool = False,
) -> list[str]:
    connection = self.connection
    truncate = _written(connection, tables)
    if set(REFERENCE_TABLES) <= set(tables):
        now = _fingerprint(connection)
        if _left.get(connection.alias) == now:
            truncate = [table for table in truncate if table not in REFERENCE_TABLES]
        else:  # truncated now, and written again by post_migrate (see _remember)
            _left.pop(connection.alias, None)
    if not truncate:
        return []
    return _full_sql_flush(
        self, style, truncate, reset_sequences=reset_sequences, allow_cascade=True
    )


def _remember(using: str, **kwargs: Any) -> None:
    """Note the reference tables of database ``using`` as ``post_migrate`` left them."""
    _left[using] = _fingerprint(connections[using])


def _written(connection: Any, tables: list[str]) -> list[str]:
    """The ``tables`` written since they were last truncated: their heap, or one of their
    partitions' (a partitioned table keeps its rows there), has a page. Those that held rows
    since, even deleted or rolled back, are truncated too, so that no dead rows are left for a
    later test to read past (one that counts the pages a statement reads)."""
    if not tables:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT t FROM unnest(%s::text[]) AS t "
            "WHERE pg_relation_size(quote_ident(t)) > 0 OR EXISTS ("
            "  SELECT FROM pg_partition_tree(quote_ident(t)) AS p"
            "  WHERE pg_relation_size(p.relid) > 0)",
            [tables],
        )
        written = {table for (table,) in cursor.fetchall()}
    return [table for table in tables if table in written]


def _fingerprint(connection: Any) -> tuple[str, ...]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + _FINGERPRINT)
        return tuple(cursor.fetchone())
