"""Shared fixtures. Every test that touches the database runs on real PostgreSQL."""

from __future__ import annotations

import os
import re

import pytest
from django.db import connection

from tests.support.concurrency import run_in_threads
from tests.support.processes import WORKER_SUFFIX, alive
from tests.support.tiers import ALONE, HEAVY

#: Acceptance tests of real worker and scheduler processes (signals, kill -9, SIGSTOP).
PROCESS_MODULES = frozenset(
    {
        "test_worker_processes.py",
        "test_scheduler_processes.py",
        "test_process_registry.py",
        "test_operator_controls_processes.py",
        "test_flow_processes.py",
        "test_workflow_processes.py",
        "test_effect_processes.py",
    }
)


def pytest_collection_modifyitems(config, items):
    """Mark the tiers (``once``, ``heavy``, ``alone``) and order the run: the slow and heavy
    tests first, so that spread over several processes none is left to run alone at the end,
    and the ``alone`` tests last, when the others are done. In a later leg of scripts/test's
    matrix, leave out the tests marked ``once`` or ``heavy``.

    ``once`` tests do not depend on the Django version (the package build, the demo script,
    the scale bench), so the first leg runs them and the others save the minutes. The browser
    tests (``tests/acceptance/test_browser*.py``) count as ``once`` too: they drive the pages'
    markup and scripts in Chromium, while the views behind them run on every leg in the
    integration tests. So do the tests that drive real ``runworker`` and ``runscheduler``
    processes through signals, crashes and stalls (:data:`PROCESS_MODULES`): what they add is
    the operating system's side, while the commands, the worker and the scheduler run on
    every leg in the integration tests.
    """
    for item in items:
        if item.path.name.startswith("test_browser") or item.path.name in PROCESS_MODULES:
            item.add_marker(pytest.mark.once)
        name = getattr(item, "originalname", item.name)
        if name in HEAVY:
            item.add_marker(pytest.mark.heavy)
        if name in ALONE:
            item.add_marker(pytest.mark.alone)
    items.sort(key=_turn_in_the_run)
    if not os.environ.get("JOBS_TEST_LATER_LEG"):
        return
    kept = [item for item in items if not _first_leg_only(item)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def _turn_in_the_run(item) -> int:
    """0 for the slow and heavy tests, 2 for those that run alone, 1 for the rest (a stable
    sort keeps each group in collection order)."""
    if item.get_closest_marker("alone"):
        return 2
    return 0 if item.get_closest_marker("slow") or item.get_closest_marker("heavy") else 1


def _first_leg_only(item) -> bool:
    return any(item.get_closest_marker(name) for name in ("once", "heavy"))


@pytest.fixture(scope="session", autouse=True)
def _quick_flush():
    """Transactional tests end with a flush of only what they filled (tests/support/flush.py)."""
    from tests.support import flush

    flush.install()


@pytest.fixture(autouse=True)
def _turn(request, tmp_path_factory):
    """Spread over several processes, each test waits for its turn (tests/support/alone.py)."""
    if not hasattr(request.config, "workerinput"):  # one process: each test runs alone
        yield
        return
    from tests.support.alone import turn

    shared = tmp_path_factory.getbasetemp().parent  # each process's base is a directory in it
    with turn(shared, alone=request.node.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    request, django_db_modify_db_settings_parallel_suffix, django_db_blocker
):
    """Before the test database is created, drop those left by runs that were killed; point
    the ``other`` alias at its own server if a collected test uses it (tests/support/otherdb.py)."""
    from tests.support import otherdb

    with django_db_blocker.unblock():
        _drop_orphaned_test_databases()
        otherdb.prepare(request.session.items)


def _drop_orphaned_test_databases() -> None:
    """Test databases are named after their run's process id (tests/settings.py), with
    :data:`WORKER_SUFFIX` when the run is spread over several processes."""
    prefix = f"test_{connection.settings_dict['NAME']}_"
    with connection._nodb_cursor() as cur:
        cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", [prefix + "%"])
        for (name,) in cur.fetchall():
            match = re.fullmatch(re.escape(prefix) + r"(\d+)" + WORKER_SUFFIX, name)
            if match and not alive(int(match.group(1))):
                cur.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture
def threads():
    return run_in_threads


@pytest.fixture(params=["scan", "walk"])
def claim_form(request, monkeypatch):
    """Run a test with each form of the claim statement: the single ordered scan (PostgreSQL
    18+) and the priority walk (forced by making the connection report an older server)."""
    from django.db import connection

    connection.ensure_connection()
    if request.param == "walk":
        monkeypatch.setattr(connection, "pg_version", 170000)
    elif connection.pg_version < 180000:
        pytest.skip("the single-scan claim is used from PostgreSQL 18 on")
    return request.param
