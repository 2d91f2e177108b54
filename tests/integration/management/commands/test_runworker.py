"""runworker refuses bad configuration before it starts."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from jobs.worker.config import WorkerConfig, env_scope, scope_from
from jobs.worker.runner import Worker
from tests.support.pgbouncer import pgbouncer_fixture, skip_reason  # noqa: F401


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenant": "bad tenant"}, "invalid worker scope: tenant must be 1-64 characters"),
        ({"component": "no/slash"}, "invalid worker scope: component must be 1-64 characters"),
        ({"tenant": "acme", "component": "mailer"}, "either --tenant"),
        ({"concurrency": 0}, "concurrency must be from 1 to 1000"),
        ({"shutdown_timeout": 0}, "shutdown timeout must be positive"),
        ({"http_port": 70000}, "HTTP port must be from 0 to 65535"),
    ],
)
def test_invalid_options_are_refused(options, message):
    with pytest.raises(CommandError, match=message):
        call_command("runworker", **options)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("WORKER_CONCURRENCY", "many", "WORKER_CONCURRENCY must be a number"),
        ("WORKER_BRANCH", "not valid!", "tenant must be 1-64 characters"),
    ],
)
def test_invalid_environment_is_refused(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(CommandError, match=message):
        call_command("runworker")


def test_environment_selects_the_scope():
    assert env_scope({"WORKER_BRANCH": "acme"}) == ("acme", None)
    assert env_scope({"WORKER_COMPONENT": "mailer", "WORKER_BRANCH": ""}) == (None, "mailer")
    assert repr(scope_from("acme", None)) == "OnlyTenant(tenant='acme')"
    assert repr(scope_from(None, None)) == "AllTenantsExcept(component='worker')"
    assert WorkerConfig().scope == scope_from(None, "worker")


@pytest.mark.django_db(transaction=True)
def test_the_default_concurrency_is_twenty_threads(monkeypatch):
    """Without --concurrency or WORKER_CONCURRENCY a worker runs 20 handler threads, and
    its help and WorkerConfig agree (docs/worker.md says why 20)."""
    from jobs.management.commands import runworker

    made: list[WorkerConfig] = []

    class Stub:
        def __init__(self, registry, config):
            made.append(config)

        def run(self):
            return 0

    monkeypatch.delenv("WORKER_CONCURRENCY", raising=False)
    monkeypatch.setattr(runworker, "Worker", Stub)
    call_command("runworker")
    assert [config.concurrency for config in made] == [20]
    assert WorkerConfig().concurrency == 20
    parser = runworker.Command().create_parser("manage.py", "runworker")
    help_text = next(a.help for a in parser._actions if "--concurrency" in a.option_strings)
    assert "default 20" in help_text


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("silenced", [False, True])
def test_runworker_warns_at_start_up_of_prepared_statements_behind_a_pooler(
    pgbouncer, monkeypatch, silenced
):
    """As it checks the alias's tables, runworker warns (``jobs.W030``) when
    ``JOBS["PREPARED_STATEMENTS"]`` is on and its database is reached through a pooler, then
    runs; ``SILENCED_SYSTEM_CHECKS`` silences it, as it does the check."""
    started: list[str] = []
    monkeypatch.setattr(Worker, "run", lambda self: started.append(self.config.database))
    err = io.StringIO()
    silence = ["jobs.W030"] if silenced else []
    with (
        override_settings(JOBS={"PREPARED_STATEMENTS": True}, SILENCED_SYSTEM_CHECKS=silence),
        pgbouncer.routing(),
    ):
        call_command("runworker", stderr=err)
        connection.close()
    assert started == ["default"]
    warned = err.getvalue()
    if silenced:
        assert warned == ""
    else:
        assert "jobs.W030" in warned and "max_prepared_statements" in warned, warned
