"""Prepared statements in tests: the default alias set to prepare, and a session of its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from django.db import connection
from django.test import override_settings

from jobs.db import bounds as dbbounds


@contextlib.contextmanager
def prepare_threshold(value: int | None) -> Iterator[None]:
    """The default alias's ``OPTIONS["prepare_threshold"]`` meanwhile, from its next connect
    on (0: psycopg prepares every statement from its first use); closed again afterwards."""
    options = connection.settings_dict["OPTIONS"]
    saved = dict(options)
    options["prepare_threshold"] = value
    connection.close()
    try:
        yield
    finally:
        options.clear()
        options.update(saved)
        connection.close()


@contextlib.contextmanager
def queue_prepares(on: bool) -> Iterator[None]:
    """``JOBS["PREPARED_STATEMENTS"]`` meanwhile, on a fresh connection (closed again after)."""
    connection.close()
    try:
        with override_settings(JOBS={"PREPARED_STATEMENTS": on}):
            yield
    finally:
        connection.close()


def other_session() -> psycopg.Connection:
    """A connection of its own to the test database, as a deploy's migration has."""
    return psycopg.connect(**dbbounds.connect_params(connection), autocommit=True)
