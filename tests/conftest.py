"""Shared fixtures. Every test that touches the database runs on real PostgreSQL."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

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
    """In a later leg of scripts/test's matrix, leave out the tests marked ``once``.

    They do not depend on the Django version (the package build, the demo script, the scale
    bench), so the first leg runs them and the others save the minutes. The browser tests
    (``tests/acceptance/test_browser*.py``) count as ``once`` too: they drive the pages'
    markup and scripts in Chromium, while the views behind them run on every leg in the
    integration tests. So do the tests that drive real ``runworker`` and ``runscheduler``
    processes through signals, crashes and stalls (:data:`PROCESS_MODULES`): what they add is
    the operating system's side, while the commands, the worker and the scheduler run on
    every leg in the integration tests.
    """
    for item in items:
        if item.path.name.startswith("test_browser") or item.path.name in PROCESS_MODULES:
            item.add_marker(pytest.mark.once)
    if not os.environ.get("JOBS_TEST_LATER_LEG"):
        return
    kept = [item for item in items if item.get_closest_marker("once") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    request, django_db_modify_db_settings_parallel_suffix, django_db_blocker
):
    """Before the test database is created, drop those left by runs that were killed; point
    the ``other`` alias at its own server if a collected test uses it (tests/otherdb.py)."""
    from tests import otherdb

    with django_db_blocker.unblock():
        _drop_orphaned_test_databases()
        otherdb.prepare(request.session.items)


#: The suffix pytest-django gives a test database in each pytest-xdist worker (``_gw0``, ...).
WORKER_SUFFIX = r"(?:_gw\d+)?"


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


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a test run's, whose database is then in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_in_threads(count: int, target: Callable[[int], Any], timeout: float = 30) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads released together; return results in order.

    Each thread uses its own database connection (Django connections are per thread) and
    closes it when done. An exception in any thread is re-raised here.
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait(timeout)
            results[index] = target(index)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a test thread did not finish in time"
    if errors:
        raise errors[0]
    return results


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
