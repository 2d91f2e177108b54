"""The second PostgreSQL of the several-databases tests: the ``other`` alias, on its own server.

tests/settings.py declares ``other`` as a second database on the default server. Before the test
databases are made, :func:`prepare` points it at a second embedded server instead (its data
under ``var/postgres-other``, started by ``project.devdb`` with ``DEVDB_PGDATA`` and left
running for the rest of the run, as the first one is), but only when a collected test asks for
``other``: the rest of the suite never starts it. ``scripts/test`` stops both at its end if it
started them (unless ``--keep-db``), and ``python -m project.devdb stop`` stops both. Where that
server cannot start (no embedded wheel), the alias stays a second database on the default
server, and :data:`SEPARATE_SERVER` says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import psycopg

from tests.support.processes import WORKER_SUFFIX, alive

ALIAS = "other"
ROOT = Path(__file__).resolve().parents[2]
PGDATA = ROOT / "var" / "postgres-other"
#: Whether ``other`` is on a server of its own (set by :func:`prepare`).
SEPARATE_SERVER = False


def wanted(items) -> bool:
    """Whether a collected test names the ``other`` alias in its ``django_db`` marker."""
    for item in items:
        marker = item.get_closest_marker("django_db")
        databases = marker.kwargs.get("databases", ()) if marker else ()
        if databases == "__all__" or ALIAS in databases:
            return True
    return False


def prepare(items) -> None:
    """Point ``other`` at the second server when a test needs it; drop orphaned test databases."""
    global SEPARATE_SERVER
    if not wanted(items):
        return
    from django.db import connections

    settings = connections.settings[ALIAS]
    url = _second_server()
    if url is None:
        warnings.warn(
            "the second PostgreSQL server could not start: the several-databases tests use a "
            "second database on the default server instead",
            stacklevel=1,
        )
    else:
        parts = urlsplit(url)
        settings.update(
            HOST=unquote(parts.hostname or ""),
            PORT=str(parts.port or 5432),
            USER=unquote(parts.username or "postgres"),
            PASSWORD=unquote(parts.password or ""),
            NAME=parts.path.lstrip("/"),
        )
        SEPARATE_SERVER = True
    _drop_orphans(settings)


def _second_server() -> str | None:
    """Start (if needed) the second embedded server and return its URL; None if it cannot."""
    if os.environ.get("TEST_OTHER_SERVER_URL"):
        return os.environ["TEST_OTHER_SERVER_URL"]  # a server of the caller's choosing
    try:
        done = subprocess.run(
            [sys.executable, "-m", "project.devdb", "url"],
            cwd=ROOT,
            env={**os.environ, "DEVDB_PGDATA": str(PGDATA)},
            capture_output=True,
            text=True,
            timeout=180,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else None


def _drop_orphans(settings: dict) -> None:
    """Test databases of ``other`` are named after their run's pid; drop those of dead runs."""
    name = re.sub(WORKER_SUFFIX + "$", "", settings["TEST"]["NAME"])
    pattern = re.compile(re.escape(name).replace(str(os.getpid()), r"(\d+)") + WORKER_SUFFIX)
    params = {
        "host": settings["HOST"] or None,
        "port": settings["PORT"] or None,
        "user": settings["USER"] or None,
        "password": settings["PASSWORD"] or None,
        "dbname": "postgres",
    }
    with psycopg.connect(**{k: v for k, v in params.items() if v}, autocommit=True) as conn:
        for (found,) in conn.execute("SELECT datname FROM pg_database").fetchall():
            match = pattern.fullmatch(found)
            if match and not alive(int(match.group(1))):
                conn.execute(f'DROP DATABASE IF EXISTS "{found}"')


def url(settings: dict, name: str) -> str:
    """A ``postgres://`` URL of the server in ``settings`` and the database ``name``."""
    host = quote(settings["HOST"] or "localhost", safe="")
    password = f":{quote(settings['PASSWORD'])}" if settings.get("PASSWORD") else ""
    port = settings.get("PORT") or 5432
    return f"postgres://{quote(settings['USER'] or 'postgres')}{password}@{host}:{port}/{name}"
