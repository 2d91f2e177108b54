"""The queue, the worker's maintenance and the admin through PgBouncer in transaction mode.

Each test takes the ``pgbouncer`` fixture (tests/pgbouncer.py): a private pooler whose few
server connections are handed out round robin, so consecutive transactions of one client run
on different backends and anything that leans on session state shows up here.
"""

from __future__ import annotations

import pytest
from django.db import connection

from tests.pgbouncer import pgbouncer_fixture  # noqa: F401  (provides `pgbouncer`)

pytestmark = [pytest.mark.django_db(transaction=True)]


def _backend(conn) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def test_the_fixture_pools_by_transaction(pgbouncer):
    """Two consecutive transactions of one client land on different backends."""
    assert pgbouncer.show("CONFIG") and pgbouncer.pool_mode == "transaction"
    with pgbouncer.connect() as client, pgbouncer.connect() as other:
        with client.transaction():
            first = _backend(client)
        with other.transaction():  # holds a server, so the client's next one is another
            held = _backend(other)
            with client.transaction():
                second = _backend(client)
        assert first != second and second != held
        seen = set()
        for _ in range(2 * pgbouncer.pool_size):
            with client.transaction():
                seen.add(_backend(client))
    assert len(seen) > 1


def test_routing_sends_djangos_connection_through_the_pooler(pgbouncer):
    direct = connection.settings_dict["HOST"]
    with pgbouncer.routing():
        assert connection.settings_dict["PORT"] == str(pgbouncer.port)
        with connection.cursor() as cur:
            cur.execute("SELECT current_database()")
            assert cur.fetchone()[0] == pgbouncer.dbname
        clients = [c for c in pgbouncer.show("CLIENTS") if c["database"] == pgbouncer.dbname]
        assert clients
    assert connection.settings_dict["HOST"] == direct
