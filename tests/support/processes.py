"""Processes in tests: ``manage.py`` commands started by a test, and whether a pid is alive."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

from django.db import connection

from tests.support.polling import wait_for


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a test run's, whose database is then in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ROOT = Path(__file__).resolve().parents[2]


def database_url_for_tests() -> str:
    params = connection.settings_dict
    host = quote(params["HOST"] or "localhost", safe="")
    password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
    port = params.get("PORT") or 5432
    return f"postgres://{quote(params['USER'])}{password}@{host}:{port}/{params['NAME']}"


#: What :func:`outcome_log` records into.
OUTCOMES_TABLE = "test_outcomes"


class Process:
    """A manage.py command running in its own process, its output captured in a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), *args],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_output(self, pattern: str, timeout: float = 20.0) -> re.Match:
        return wait_for(
            lambda: re.search(pattern, self.output()), timeout, what=f"output /{pattern}/"
        )

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


def read_trace(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


#: The suffix pytest-django gives a test database in each pytest-xdist worker (``_gw0``, ...).
WORKER_SUFFIX = r"(?:_gw\d+)?"
