"""``scripts/demo`` as a terminal runs it: piped into ``tee``, then Ctrl-C, SIGTERM or SIGHUP.

Each demo runs ``bash -c './scripts/demo | tee out'`` in a session of its own, as a shell runs
a pipeline, and every process it starts carries a unique environment variable, so the test
finds them all (whatever their process group) in ``/proc``. The demo uses its own database:
a fresh one on the test server, or a private embedded server (``DEVDB_PGDATA``) where the test
checks that the demo stops the database it started.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection

from tests.support.polling import wait_for

# once: the same on every Django version, so scripts/test runs it in the first leg only.
pytestmark = [pytest.mark.acceptance, pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).resolve().parents[2]
BANNER = re.compile(
    r"={20,}\n  Admin: +(?P<url>\S+)\n  Username: +admin\n  Password: +(?P<password>\S+)\n"
    r"(?:  .*\n)*={20,}\n"
)
# What the test process has that a user starting the demo would not.
INHERITED_NOT = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "DEVDB_PGDATA", "DEMO_KEEP_DB", "PORT"}
if not Path("/proc/self/environ").exists():  # pragma: no cover - Linux only
    pytest.skip("finds the demo's processes through /proc", allow_module_level=True)


class Demo:
    """One ``scripts/demo | tee`` pipeline and every process it started."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str) -> None:
        tmp_path.mkdir()
        self.out = tmp_path / "demo.out"
        self.logs = tmp_path / "logs"
        self.port = free_port()
        self.marker = uuid.uuid4().hex
        base = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}
        env = {
            **base,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "DEMO_SKIP_INSTALL": "1",  # the venv this test runs in is the demo's
            "DEMO_LOG_DIR": str(self.logs),
            "DEMO_TEST_MARK": self.marker,
            "EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend",
            "PORT": str(self.port),
            **env,
        }
        command = " ".join(["./scripts/demo", *args, "|", "tee", shlex.quote(str(self.out))])
        self.proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            start_new_session=True,  # a process group of its own, like a terminal's job
            # As a terminal starts it: a test run launched in the background (nohup, `&` in a
            # script) passes on SIGHUP and SIGINT ignored, and a shell cannot trap a signal
            # it was started ignoring, so the demo would never see the Ctrl-C under test.
            preexec_fn=_default_stop_signals,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "demo.err", "w"),  # noqa: SIM115 - lives as long as the demo
        )

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def banners(self) -> list[re.Match]:
        return list(BANNER.finditer(self.output()))

    def wait_for_banners(self, count: int = 1) -> re.Match:
        # A demo on a private data directory runs initdb, migrations and seeding first: about
        # 15 s on an idle 2-core machine, over 60 s once when the machine was busy in CI.
        wait_for(lambda: len(self.banners()) >= count, timeout=180, what=f"{count} banner(s)")
        return self.banners()[-1]

    def assert_banner_is_last(self) -> re.Match:
        last = self.banners()[-1]
        assert last.end() == len(self.output()), f"printed after the banner:\n{self.output()}"
        return last

    def script_pid(self) -> int:
        """The demo script's own pid, as its banner names it."""
        return int(re.search(r"kill -USR1 (\d+)", self.output()).group(1))

    def processes(self, *, postgres: bool = True) -> dict[int, str]:
        """pid → command line of every live process started by this demo."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            ours = f"DEMO_TEST_MARK={self.marker}".encode() in environ and cmdline
            if ours and (postgres or "postgres" not in cmdline):
                found[int(entry.name)] = cmdline
        return found

    def servers(self) -> dict[int, str]:
        return {
            pid: cmd
            for pid, cmd in self.processes().items()
            if re.search(r"manage\.py (runserver|runworker|runscheduler)", cmd)
        }

    def wait_until_gone(self, *, postgres: bool = True) -> None:
        try:
            wait_for(lambda: not self.processes(postgres=postgres), timeout=30, what="stopped")
        except AssertionError:
            left = "\n".join(f"  {pid}: {cmd}" for pid, cmd in self.processes().items())
            message = f"the demo did not stop within 30s; still running:\n{left}"
            raise AssertionError(message) from None

    def kill(self) -> None:
        """Teardown: whatever this demo left behind, by pid."""
        for pid in self.processes(postgres=False):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def _default_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_in(url: str, password: str) -> str:
    """Log in to the admin with the printed password; return the page it lands on."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    login = urllib.parse.urljoin(url, "login/")
    page = opener.open(login, timeout=5).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    data = {"csrfmiddlewaretoken": token, "username": "admin", "password": password, "next": url}
    request = urllib.request.Request(
        login, urllib.parse.urlencode(data).encode(), headers={"Referer": login}
    )
    return opener.open(request, timeout=5).read().decode()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.parse.urljoin(url, "login/"), timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def demo_database(django_db_blocker):
    """A new, empty database on the test server, dropped afterwards: the demo's own."""
    name = f"test_demo_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with django_db_blocker.unblock(), connection._nodb_cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    params = connection.settings_dict
    host = quote(params["HOST"] or "localhost", safe="")
    password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
    yield f"postgres://{quote(params['USER'])}{password}@{host}:{params['PORT'] or 5432}/{name}"
    with django_db_blocker.unblock(), connection._nodb_cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def private_pgdata(server_tmp_path):
    """Where a demo without DATABASE_URL starts an embedded server of its own.

    Request it before ``demos``, so the demos are gone before their database is stopped.
    """
    pgdata = server_tmp_path / "pg"
    yield pgdata
    devdb(pgdata, "stop")
    with contextlib.suppress(OSError, ValueError):  # still up: stop its postmaster directly
        pid = int((pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown
        wait_for(
            lambda: not (pgdata / "postmaster.pid").exists(), what="postmaster stopped", timeout=20
        )
    shutil.rmtree(pgdata, ignore_errors=True)


def devdb(pgdata: Path, command: str) -> int:
    """``python -m project.devdb <command>`` for the embedded server under ``pgdata``."""
    return subprocess.run(
        [sys.executable, "-m", "project.devdb", command],
        cwd=ROOT,
        env={**os.environ, "DEVDB_PGDATA": str(pgdata)},
        capture_output=True,
        timeout=60,
    ).returncode


@pytest.fixture
def demos(tmp_path):
    started: list[Demo] = []

    def start(env: dict[str, str], *args: str) -> Demo:
        demo = Demo(tmp_path / f"demo-{len(started)}", env, *args)
        started.append(demo)
        return demo

    yield start
    for demo in started:
        demo.kill()


def embedded_running(pgdata: Path) -> bool:
    return devdb(pgdata, "status") == 0


def test_ctrl_c_through_a_pipe_stops_every_server_and_the_login_is_printed_last(
    demos, demo_database
):
    demo = demos({"DATABASE_URL": demo_database})

    banner = demo.wait_for_banners()
    assert answers(banner["url"]) and banner["url"] == f"http://127.0.0.1:{demo.port}/admin/"
    assert "Log out" in log_in(banner["url"], banner["password"])
    assert {"runserver", "runworker", "runscheduler"} <= set(
        re.findall(r"run\w+", " ".join(demo.servers().values()))
    )
    demo.assert_banner_is_last()  # the servers log to files, not over the login

    os.kill(demo.script_pid(), signal.SIGUSR1)  # asked again, it prints the login again
    assert demo.wait_for_banners(2)["password"] == banner["password"]
    demo.assert_banner_is_last()

    os.killpg(demo.proc.pid, signal.SIGINT)  # Ctrl-C: the script and tee; tee dies

    demo.wait_until_gone()
    assert demo.proc.wait(10) != 0
    assert (demo.logs / "worker.log").exists()


def test_setup_only_prints_the_login_and_starts_nothing(demos, demo_database):
    demo = demos({"DATABASE_URL": demo_database}, "--setup-only")

    assert demo.proc.wait(60) == 0
    demo.assert_banner_is_last()
    assert not demo.processes()


def test_a_closed_terminal_stops_the_servers_and_the_embedded_database_it_started(
    private_pgdata, demos
):
    demo = demos({"DEVDB_PGDATA": str(private_pgdata)})
    demo.wait_for_banners()
    assert embedded_running(private_pgdata)

    os.killpg(demo.proc.pid, signal.SIGHUP)

    demo.wait_until_gone()  # the PostgreSQL server's processes too
    assert not embedded_running(private_pgdata)


def test_sigterm_with_keep_db_stops_the_servers_and_leaves_the_database_running(
    private_pgdata, demos
):
    demo = demos({"DEVDB_PGDATA": str(private_pgdata), "DEMO_KEEP_DB": "1"})
    demo.wait_for_banners()

    os.kill(demo.script_pid(), signal.SIGTERM)  # a process manager stops the script alone

    demo.wait_until_gone(postgres=False)
    assert embedded_running(private_pgdata)
    assert "left running" in demo.output()
