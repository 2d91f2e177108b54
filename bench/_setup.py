"""Point Django at a scratch benchmark database (created and migrated on first use).

Benchmarks never touch the development database: they use ``<dbname>_bench`` on the same
server (the embedded one when DATABASE_URL is unset).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent


def setup(suffix: str = "_bench") -> str:
    """Create/migrate the benchmark database, configure Django for it; returns its URL."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    base = os.environ.get("DATABASE_URL")
    if not base:
        from project import devdb

        base = devdb.database_url()
    parts = urlsplit(base)
    name = parts.path.lstrip("/") + suffix
    url = urlunsplit(parts._replace(path="/" + name))
    _create_database(base, name)
    os.environ["DATABASE_URL"] = url
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    return url


def _create_database(base_url: str, name: str) -> None:
    from urllib.parse import unquote

    import environ
    import psycopg

    cfg = environ.Env.db_url_config(base_url)
    conn = psycopg.connect(
        host=unquote(cfg["HOST"]),
        port=cfg["PORT"] or 5432,
        user=cfg["USER"],
        password=cfg["PASSWORD"] or None,
        dbname=cfg["NAME"],
        autocommit=True,
    )
    with conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
