"""Whether a connection owns its server session, or a pooler stands between.

A LISTEN (jobs.worker.wakeup) and a prepared statement (``JOBS["PREPARED_STATEMENTS"]``, the
check ``jobs.W030``) both live on the server session: behind a pooler they stay on a server
connection that the next transaction may not get.
"""

from __future__ import annotations

from typing import Any

import psycopg


def owns_its_session(conn: psycopg.Connection[Any]) -> bool:
    """Whether the backend that answers on ``conn`` is the one the connection was opened with.

    PostgreSQL names the backend process of a new session in its reply to the start-up (the
    key a cancel request quotes, which libpq reports as ``backend_pid``). A pooler answers the
    start-up itself, with a key of its own, as it cannot know which server connection will
    run each statement: behind PgBouncer (any pool mode) and the other poolers the two differ.
    A TCP or TLS proxy passes the reply through: the session is then the connection's own as
    on a direct one. One statement that leaves nothing behind.
    """
    return conn.info.backend_pid == backend_pid(conn)


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    """The pid of the backend that answers this statement (``pg_backend_pid()``)."""
    row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
    assert row is not None
    return int(row[0])
