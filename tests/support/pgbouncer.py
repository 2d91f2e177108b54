"""Debian's PgBouncer in transaction mode, started by a test in front of the test database.

Production Django often reaches PostgreSQL through PgBouncer, and managed PostgreSQL often
forces transaction pooling: each transaction (each statement, in autocommit) may run on a
different server connection, so nothing may depend on session state. :class:`PgBouncer`
starts a private pooler on a free loopback port with its own config, auth, pid and log files
and a small pool (:data:`POOL_SIZE` server connections) so that consecutive transactions of one
client really do land on different backends.

Use the ``pgbouncer`` fixture (``from tests.support.pgbouncer import pgbouncer_fixture`` in a test
module makes it available; it skips the test, saying why, where pgbouncer is not installed:
``scripts/test`` installs it with apt-get when it runs as root). What goes through the pooler
must be committed to be seen by the other side, so tests that use it take ``transactional_db``
(or ``django_db(transaction=True)``), not ``db``.

    def test_x(pgbouncer, transactional_db):
        with pgbouncer.routing():        # this thread's default connection goes through it
            ...
        url = pgbouncer.database_url()   # for a runworker process's DATABASE_URL
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connections

#: Server connections per (database, user) pair: small, so transactions mix across backends.
POOL_SIZE = 5
#: Client connections the pooler accepts: generous, a worker process opens several.
MAX_CLIENTS = 500
#: Seconds PgBouncer refuses every client after a failed server login (a database restart):
#: what docs/operating-at-scale.md recommends, well under a lease, instead of PgBouncer's 15.
SERVER_LOGIN_RETRY = 1
#: ``-c`` settings the project sends in ``options`` (jobs.db.bounds), applied per client by
#: PgBouncer 1.20+ when tracked; older versions can only be told to ignore ``options``.
TRACKED = ("statement_timeout", "lock_timeout")


# Settings PgBouncer itself sets on a server for each client it lends it to.
_POOLER_TRACKED = (
    "client_encoding",
    "datestyle",
    "timezone",
    "standard_conforming_strings",
    "application_name",
    "intervalstyle",
    *TRACKED,
)
_SESSION_KEYS = ("listening", "prepared", "advisory_locks", "temp_tables", "settings")
_SESSION_STATE = """
SELECT pg_backend_pid(),
       ARRAY(SELECT pg_listening_channels()),
       ARRAY(SELECT name FROM pg_prepared_statements),
       (SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted),
       ARRAY(SELECT relname::text FROM pg_class WHERE relnamespace = pg_my_temp_schema()),
       ARRAY(SELECT name || '=' || setting FROM pg_settings
             WHERE source = 'session' AND lower(name) <> ALL(%s))
"""


def executable() -> str | None:
    """The pgbouncer binary (Debian puts it in /usr/sbin, which a user's PATH may lack)."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


def version(binary: str | None = None) -> tuple[int, ...]:
    """PgBouncer's version, e.g. (1, 18, 0); () where it is not installed."""
    binary = binary or executable()
    if binary is None:
        return ()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"PgBouncer (\d+)\.(\d+)(?:\.(\d+))?", out.stdout + out.stderr)
    return tuple(int(part) for part in match.groups(default="0")) if match else ()


def skip_reason() -> str | None:
    """Why the pooler tests cannot run here, or None when they can."""
    if executable() is None:
        return (
            "pgbouncer is not installed (scripts/test installs Debian's package when run as "
            "root with apt-get; or: apt-get install pgbouncer)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One pgbouncer process in front of the database of ``settings`` (a Django alias's dict).

    ``pool_mode`` is ``transaction`` unless told otherwise; ``pool_size`` is the number of
    server connections it may open to the database (per user). Servers are lent round robin,
    so that a client's transactions move between them; ``round_robin=False`` is PgBouncer's
    own default, the server used last is lent first, so an idle client's next transaction
    usually lands on the backend of its last one.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        settings: dict[str, Any] | None = None,
        *,
        pool_mode: str = "transaction",
        pool_size: int = POOL_SIZE,
        round_robin: bool = True,
    ) -> None:
        binary = executable()
        if binary is None:
            raise RuntimeError(skip_reason())
        self.binary = binary
        self.version = version(binary)
        self.settings = dict(settings or connections[DEFAULT_DB_ALIAS].settings_dict)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.round_robin = round_robin
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="test-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"

    # Where the pooler sends its server connections: the test database's socket directory
    # (the embedded PostgreSQL listens on a Unix socket only) or its host.
    @property
    def _server_host(self) -> str:
        return str(self.settings.get("HOST") or "localhost")

    @property
    def _server_port(self) -> int:
        return int(self.settings.get("PORT") or 5432)

    @property
    def user(self) -> str:
        return str(self.settings.get("USER") or pwd.getpwuid(os.getuid()).pw_name)

    @property
    def dbname(self) -> str:
        return str(self.settings["NAME"])

    def _run_as(self) -> str | None:
        """The user to run as: pgbouncer refuses to run as root.

        As root, run as the owner of the server's socket directory (who can reach the socket),
        or as ``nobody`` for a TCP server; otherwise as ourselves.
        """
        if os.geteuid() != 0:
            return None
        if self._server_host.startswith("/"):
            owner = os.stat(self._server_host).st_uid
            if owner != 0:
                return pwd.getpwuid(owner).pw_name
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                return pwd.getpwnam(name).pw_name
        raise RuntimeError("pgbouncer refuses to run as root and no other user was found")

    def _config(self) -> str:
        password = self.settings.get("PASSWORD") or ""
        server = f"host={self._server_host} port={self._server_port}"
        if password:
            server += f" password={password}"
        if self.version >= (1, 20):
            params = (
                "ignore_startup_parameters = extra_float_digits\n"
                f"track_extra_parameters = IntervalStyle, {', '.join(TRACKED)}\n"
            )
        else:  # no way to honour options' -c settings: accept and drop them
            params = "ignore_startup_parameters = extra_float_digits, options\n"
        return (
            "[databases]\n"
            f"* = {server}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.host}\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            f"admin_users = {self.user}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"max_client_conn = {MAX_CLIENTS}\n"
            f"default_pool_size = {self.pool_size}\n"
            f"min_pool_size = {self.pool_size}\n"
            f"server_round_robin = {int(self.round_robin)}\n"
            "reserve_pool_size = 0\n"
            f"server_login_retry = {SERVER_LOGIN_RETRY}\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n" + params
        )

    def start(self, timeout: float = 15.0) -> PgBouncer:
        """Start on a free port and wait until it answers; retried if the port was taken."""
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        run_as = self._run_as()
        if run_as is not None:
            entry = pwd.getpwnam(run_as)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        last = ""
        for _attempt in range(3):
            self.port = _free_port()
            (self.dir / "pgbouncer.ini").write_text(self._config())
            command = [self.binary, "-q", *(["-u", run_as] if run_as else [])]
            self.process = subprocess.Popen(
                [*command, str(self.dir / "pgbouncer.ini")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            if self._wait_ready(timeout):
                self._warm()
                return self
            last = self._stop_process()
        raise RuntimeError(f"pgbouncer did not start: {last}\n{self.log_text()}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with psycopg.connect(**self.connect_kwargs(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                time.sleep(0.05)  # polling the pooler's start, with the deadline above
        return False

    def _warm(self) -> None:
        """Open every server connection now, so that (round robin) transactions mix at once.

        Each of ``pool_size`` clients holds a transaction open while the others start theirs,
        which makes the pooler open a server connection for each.
        """
        with contextlib.ExitStack() as stack:
            for _ in range(self.pool_size):
                conn = stack.enter_context(psycopg.connect(**self.connect_kwargs()))
                stack.enter_context(conn.transaction())
                conn.execute("SELECT 1")

    def stop(self) -> None:
        self._stop_process()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stop_process(self) -> str:
        process, self.process = self.process, None
        if process is None:
            return ""
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # immediate shutdown: clients are cut
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return (process.stderr.read().decode(errors="replace") if process.stderr else "").strip()

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    # How clients reach the database through the pooler.

    def connect_kwargs(self, dbname: str | None = None) -> dict[str, Any]:
        """Keywords for ``psycopg.connect()`` through the pooler (autocommit)."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "dbname": dbname or self.dbname,
            "autocommit": True,
        }

    def connect(self, dbname: str | None = None) -> psycopg.Connection[Any]:
        """A plain psycopg connection through the pooler (prepared statements off)."""
        conn = psycopg.connect(**self.connect_kwargs(dbname))
        conn.prepare_threshold = None
        return conn

    def settings_dict(self, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """A Django ``DATABASES`` entry: ``base`` (the default alias's) through the pooler."""
        base = dict(base or self.settings)
        test = dict(base.get("TEST") or {})
        return {**base, "HOST": self.host, "PORT": str(self.port), "TEST": test}

    def database_url(self, dbname: str | None = None) -> str:
        """A ``DATABASE_URL`` through the pooler, for a child process."""
        password = self.settings.get("PASSWORD") or ""
        auth = quote(self.user) + (f":{quote(password)}" if password else "")
        return f"postgres://{auth}@{self.host}:{self.port}/{dbname or self.dbname}"

    @contextlib.contextmanager
    def routing(self, alias: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
        """Send every new connection for ``alias``, in every thread, through the pooler.

        Django's connection objects (one per thread) share the alias's settings dict, so it is
        changed in place: a worker started inside the block (its loop, handler threads, lease
        keeper and listener) connects through the pooler. This thread's connection is closed
        on the way in and out; other threads' open connections stay where they are.
        """
        shared = connections.settings[alias]
        saved = {key: shared.get(key) for key in ("HOST", "PORT")}
        connections[alias].close()
        shared.update(HOST=self.host, PORT=str(self.port))
        try:
            yield
        finally:
            connections[alias].close()
            shared.update(saved)

    def session_state(self) -> dict[int, dict[str, Any]]:
        """What each server connection of the pool keeps between transactions, by backend pid.

        Every server is visited: ``pool_size`` clients each hold a transaction open at once,
        so each holds a different one. Reported per backend: channels it LISTENs on, prepared
        statements, session advisory locks, temporary tables, and settings changed by a
        ``SET`` without ``LOCAL`` (those the pooler itself tracks per client left out).
        """
        state: dict[int, dict[str, Any]] = {}
        with contextlib.ExitStack() as stack:
            for _ in range(self.pool_size):
                conn = stack.enter_context(psycopg.connect(**self.connect_kwargs()))
                conn.prepare_threshold = None
                stack.enter_context(conn.transaction())
                row = conn.execute(_SESSION_STATE, [list(_POOLER_TRACKED)]).fetchone()
                assert row is not None
                pid, *values = row
                state[pid] = dict(zip(_SESSION_KEYS, values, strict=True))
        return state

    def leftovers(self) -> dict[int, dict[str, Any]]:
        """:meth:`session_state` of the servers that keep anything at all."""
        return {
            pid: {key: value for key, value in found.items() if value}
            for pid, found in self.session_state().items()
            if any(found.values())
        }

    def show(self, what: str) -> list[dict[str, Any]]:
        """Rows of the admin console's ``SHOW <what>`` (POOLS, SERVERS, CLIENTS, ...)."""
        with psycopg.connect(**self.connect_kwargs("pgbouncer")) as conn:
            cur = conn.execute(f"SHOW {what}")
            names = [column.name for column in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@pytest.fixture(name="pgbouncer")
def pgbouncer_fixture(django_db_setup: None) -> Iterator[PgBouncer]:
    """A transaction-mode PgBouncer in front of the test database, stopped at teardown."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with PgBouncer() as bouncer:
        yield bouncer
