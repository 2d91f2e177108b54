"""Real worker processes against the test database, with signals, kill -9 and SIGSTOP."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection, connections

from tests.support.admin import REPLAY_ALL, VIEW_ALL, operator
from tests.support.browser import CHROMIUM, FLAGS, INTERVAL, SMALL, TIMEOUT_MS
from tests.support.processes import OUTCOMES_TABLE, Process, database_url_for_tests


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


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the test module; skipped where Playwright or Chromium is
    missing (scripts/test installs Debian's chromium when it can)."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: install it or set CHROMIUM=/path/to/chromium")
    # Playwright's sync API runs an event loop in this thread for the whole module; the ORM
    # calls of the tests and of the database fixtures are plain synchronous code beside it.
    with pytest.MonkeyPatch.context() as patch, sync_api.sync_playwright() as playwright:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield launched
        finally:
            launched.close()
            connections.close_all()  # the thread's connection while Playwright's loop ran


@pytest.fixture
def live(settings):
    """A short live interval, so that a test waiting for the pages' next refresh waits little."""
    settings.JOBS = {**getattr(settings, "JOBS", {}), "LIVE_REFRESH": INTERVAL}


@pytest.fixture
def context(browser, live_server):
    """A browser context (its own cookies and localStorage) logged in as ``ops``."""
    operator(
        "ops",
        *VIEW_ALL,
        *REPLAY_ALL,
        "jobs.cancel_job",
        "jobs.change_job",
        "jobs.view_process",
        "jobs.pause_work",
        password="correct horse",
    )
    made = browser.new_context(viewport=SMALL)
    made.set_default_timeout(TIMEOUT_MS)
    page = made.new_page()
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    page.close()
    yield made
    made.close()


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
