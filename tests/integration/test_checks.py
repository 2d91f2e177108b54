"""The system checks that read the database: ``jobs.W030``, prepared statements through a
pooler that answers the start-up itself (tests/support/pgbouncer.py runs PgBouncer)."""

from __future__ import annotations

import pytest
from django.core import checks
from django.db import connection
from django.test import override_settings

from jobs.checks import check_prepared_statements
from tests.support.pgbouncer import pgbouncer_fixture, skip_reason  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True)]


def ids(messages: list[checks.CheckMessage]) -> list[str]:
    return [m.id or "" for m in messages]


def test_w030_warns_when_the_setting_is_on_behind_a_pooler(pgbouncer):
    with override_settings(JOBS={"PREPARED_STATEMENTS": True}), pgbouncer.routing():
        messages = check_prepared_statements(databases=["default"])
        connection.close()
    assert ids(messages) == ["jobs.W030"]
    [warning] = messages
    assert "'default'" in warning.msg and "pooler" in warning.msg
    assert warning.hint is not None and "max_prepared_statements" in warning.hint
    assert pgbouncer.leftovers() == {}


def test_w030_is_silent_on_a_direct_connection_or_with_the_setting_off(pgbouncer):
    with override_settings(JOBS={"PREPARED_STATEMENTS": True}):
        assert check_prepared_statements(databases=["default"]) == []
    with pgbouncer.routing():
        assert check_prepared_statements(databases=["default"]) == []
        connection.close()


def test_w030_runs_only_when_the_checks_may_touch_the_database():
    """A database check: ``manage.py check --database`` and ``migrate`` run it, a plain
    ``check`` does not open a connection for it."""
    with override_settings(JOBS={"PREPARED_STATEMENTS": True}):
        assert check_prepared_statements(databases=None) == []
    registered = checks.registry.registry.get_checks(include_deployment_checks=False)
    assert check_prepared_statements in registered
    assert "database" in getattr(check_prepared_statements, "tags", ())
