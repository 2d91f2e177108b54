"""``scripts/test`` stops the embedded PostgreSQL servers it started, unless told to keep them.

The test command runs in a copy of this checkout (its tracked files, sharing the venv), so the
servers it starts under the copy's ``var/`` are its own, not the ones this test run uses: the
default one (``var/postgres``) and the several-databases tests' second one
(``var/postgres-other``, tests/support/otherdb.py). It runs one Django version and one test, which
needs both servers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.polling import wait_for

pytestmark = [pytest.mark.acceptance, pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).resolve().parents[2]
SELECTION = (
    "tests/integration/test_databases.py"
    "::test_the_other_alias_is_a_server_of_its_own_where_one_can_start"
)
SERVERS = ("postgres", "postgres-other")
# What this test run has that a developer starting the test command would not.
INHERITED_NOT = {
    "DATABASE_URL",
    "DJANGO_SETTINGS_MODULE",
    "DEVDB_PGDATA",
    "JOBS_TEST_LATER_LEG",
    "TEST_CHECKS",
    "TEST_KEEP_DB",
    "TEST_LEGS",
    "TEST_OTHER_SERVER_URL",
    "VIRTUAL_ENV",
}


def _environment(**extra: str) -> dict[str, str]:
    base = {
        key: value
        for key, value in os.environ.items()
        if key not in INHERITED_NOT and not key.startswith("PYTEST")
    }
    return {**base, **extra}


def _postmaster(pgdata: Path) -> int | None:
    """The pid of the server running on ``pgdata``, or None."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


@pytest.fixture
def checkout(server_tmp_path) -> Iterator[Path]:
    """A copy of this checkout's tracked files, with the venv linked: its var/ is its own."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("copies the files git tracks, and this is not a git checkout")
    root = server_tmp_path / "checkout"
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    (root / ".venv").symlink_to((ROOT / ".venv").resolve())
    yield root
    for name in SERVERS:  # whatever a failed test left running
        pgdata = root / "var" / name
        pid = _postmaster(pgdata)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # PostgreSQL's fast shutdown
            wait_for(lambda d=pgdata, p=pid: _postmaster(d) != p, what="stopped", timeout=20)


def run_tests(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``scripts/test`` on one Django version and one test, in ``root``, without the lint and
    type checks (the suite runs those itself)."""
    return subprocess.run(
        ["./scripts/test", *args, "-q", "-p", "no:cacheprovider", SELECTION],
        cwd=root,
        env=_environment(TEST_LEGS="django6.0", TEST_CHECKS="0", **env),
        capture_output=True,
        text=True,
        timeout=900,
    )


def running(root: Path) -> list[str]:
    return [name for name in SERVERS if _postmaster(root / "var" / name) is not None]


def _said(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_test_command_stops_the_servers_it_started(checkout):
    done = run_tests(checkout)

    assert done.returncode == 0, _said(done)
    assert "1 passed" in done.stdout, _said(done)
    assert "lint, format and type checks skipped" in done.stdout, _said(done)
    assert running(checkout) == [], _said(done)


def test_keep_db_leaves_them_running_and_devdb_stop_stops_both(checkout):
    kept = run_tests(checkout, "--keep-db")
    assert kept.returncode == 0, _said(kept)
    assert running(checkout) == list(SERVERS), _said(kept)

    # Running before the command started: not its to stop.
    again = run_tests(checkout)
    assert again.returncode == 0, _said(again)
    assert running(checkout) == list(SERVERS), _said(again)

    stop = subprocess.run(
        [sys.executable, "-m", "project.devdb", "stop"],
        cwd=checkout,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0, _said(stop)
    assert running(checkout) == [], _said(stop)
