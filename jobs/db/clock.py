"""The scheduler's clock is PostgreSQL's, so replicas on hosts with skewed clocks agree."""

from __future__ import annotations

from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, connections


def database_now(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """The database server's current time (``statement_timestamp()``), timezone-aware."""
    with connections[using].cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        now: datetime = cur.fetchone()[0]
        return now
