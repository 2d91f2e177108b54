"""System checks over the JOBS settings and the payload classes: exact ids and messages."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import checks
from django.test import override_settings

from jobs import Payload
from jobs.checks import check_database_bounds, check_registry, check_settings


def messages(jobs_setting) -> list[tuple[str, str, str | None]]:
    with override_settings(JOBS=jobs_setting):
        return [(m.id, m.msg, m.hint) for m in check_settings()]


def test_defaults_pass():
    assert messages({}) == []
    assert messages(None) == []


def test_checks_are_registered_under_the_jobs_tag():
    registered = checks.registry.registry.get_checks()
    assert check_settings in registered and check_registry in registered
    assert "jobs" in checks.registry.registry.tags_available()


def test_jobs_must_be_a_dict():
    assert messages([("LEASE", 5)]) == [
        (
            "jobs.E007",
            "JOBS must be a dict, got list.",
            "Set JOBS = {...} with the keys you want to change, or leave it out.",
        )
    ]


def test_e001_unknown_key_suggests_the_closest():
    [close, far] = messages({"LEASE_TIME": 5, "ZZZ": 1})
    assert close == ("jobs.E001", "JOBS has an unknown key 'LEASE_TIME'.", "Did you mean 'LEASE'?")
    assert far[:2] == ("jobs.E001", "JOBS has an unknown key 'ZZZ'.")
    assert far[2].startswith("Known keys: ARCHIVE_AFTER, BACKOFF_BASE, BACKOFF_CAP, ")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("LEASE", 0, "JOBS['LEASE'] must be a positive duration, got 0."),
        ("LEASE", "10s", "JOBS['LEASE'] must be a positive duration, got '10s'."),
        ("STALE_AFTER", True, "JOBS['STALE_AFTER'] must be a positive duration, got True."),
        (
            "BACKOFF_CAP",
            timedelta(seconds=-1),
            "JOBS['BACKOFF_CAP'] must be a positive duration, "
            "got datetime.timedelta(days=-1, seconds=86399).",
        ),
        ("LEASE", float("inf"), "JOBS['LEASE'] must be a positive duration, got inf."),
        (
            "FAILURE_WINDOW",
            -1,
            "JOBS['FAILURE_WINDOW'] must be zero or a positive duration, got -1.",
        ),
    ],
)
def test_e002_durations(key, value, message):
    assert messages({key: value}) == [
        ("jobs.E002", message, "Give a datetime.timedelta or a number of seconds.")
    ]


@pytest.mark.parametrize("key", ["SUCCESS_WINDOW", "FAILURE_WINDOW", "RETRY_IN_PROCESS_UP_TO"])
def test_zero_is_allowed_where_it_means_none(key):
    assert messages({key: 0}) == []


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "DEFAULT_MAX_ATTEMPTS",
            0,
            "JOBS['DEFAULT_MAX_ATTEMPTS'] must be a whole number from 1 to 2147483647, got 0.",
        ),
        (
            "DEFAULT_MAX_ATTEMPTS",
            2.5,
            "JOBS['DEFAULT_MAX_ATTEMPTS'] must be a whole number from 1 to 2147483647, got 2.5.",
        ),
        (
            "PRUNE_BATCH_SIZE",
            False,
            "JOBS['PRUNE_BATCH_SIZE'] must be a whole number of at least 1, got False.",
        ),
    ],
)
def test_e003_whole_numbers(key, value, message):
    assert messages({key: value}) == [("jobs.E003", message, None)]


def test_e004_default_tenant_and_queue_must_be_keys():
    assert messages({"DEFAULT_TENANT": "", "DEFAULT_QUEUE": "bulk mail"}) == [
        (
            "jobs.E004",
            "JOBS['DEFAULT_TENANT'] is invalid: tenant must be 1-64 characters of letters, "
            "digits, '_', '.', ':' or '-' starting with a letter or digit, got ''.",
            None,
        ),
        (
            "jobs.E004",
            "JOBS['DEFAULT_QUEUE'] is invalid: queue must be 1-64 characters of letters, "
            "digits, '_', '.', ':' or '-' starting with a letter or digit, got 'bulk mail'.",
            None,
        ),
    ]


def test_e005_retention_shorter_than_its_window():
    assert messages({"SUCCEEDED_RETENTION": timedelta(hours=1)}) == [
        (
            "jobs.E005",
            "JOBS['SUCCEEDED_RETENTION'] (1:00:00) is shorter than "
            "JOBS['SUCCESS_WINDOW'] (1 day, 0:00:00).",
            "Rows would be pruned while they still hold their job_id, so a repeat enqueue "
            "inside SUCCESS_WINDOW would run the work again. Raise SUCCEEDED_RETENTION or "
            "lower SUCCESS_WINDOW.",
        )
    ]
    assert [m[0] for m in messages({"FAILURE_WINDOW": timedelta(days=30)})] == [
        "jobs.E005",
        "jobs.E005",
    ]
    # An equal retention keeps the row exactly as long as its key: consistent.
    assert messages({"SUCCEEDED_RETENTION": 60, "SUCCESS_WINDOW": 60}) == []


def test_e006_backoff_base_above_cap():
    assert messages({"BACKOFF_BASE": 10, "BACKOFF_CAP": 5}) == [
        (
            "jobs.E006",
            "JOBS['BACKOFF_BASE'] (0:00:10) is greater than JOBS['BACKOFF_CAP'] (0:00:05).",
            "The first retry would already wait longer than the cap allows.",
        )
    ]


def test_e008_notify_must_be_a_bool():
    assert messages({"NOTIFY": "yes"}) == [
        ("jobs.E008", "JOBS['NOTIFY'] must be True or False, got 'yes'.", None)
    ]


def test_e008_prepared_statements_must_be_a_bool():
    assert messages({"PREPARED_STATEMENTS": 1}) == [
        ("jobs.E008", "JOBS['PREPARED_STATEMENTS'] must be True or False, got 1.", None)
    ]


def test_problems_are_all_reported_together():
    ids = [m[0] for m in messages({"X": 1, "LEASE": -1, "PRUNE_BATCH_SIZE": 0, "NOTIFY": 1})]
    assert sorted(ids) == ["jobs.E001", "jobs.E002", "jobs.E003", "jobs.E008"]


class TestRegistryChecks:
    def test_e010_two_classes_claiming_one_name(self):
        class FirstV1(Payload, name="checks.clash.v1"):
            n: int

        class SecondV1(Payload, name="checks.clash.v1"):
            n: int

        found = [m for m in check_registry() if "checks.clash.v1" in m.msg]
        assert [(m.id, m.msg, m.hint) for m in found] == [
            (
                "jobs.E010",
                f"Payload classes {__name__}.{FirstV1.__qualname__}, "
                f"{__name__}.{SecondV1.__qualname__} all claim the job name 'checks.clash.v1'.",
                "Give each contract its own versioned name, e.g. by bumping .vN.",
            )
        ]
        assert isinstance(found[0], checks.Error)

    def test_w001_payload_class_without_a_handler(self):
        class OrphanV1(Payload, name="checks.orphan.v1"):
            n: int

        found = [m for m in check_registry() if "checks.orphan.v1" in m.msg]
        assert [(m.id, m.msg, m.hint) for m in found] == [
            (
                "jobs.W001",
                f"Payload class {__name__}.{OrphanV1.__qualname__} ('checks.orphan.v1') has no "
                f"registered handler.",
                "Register one with @job(OrphanV1) in <app>/jobs.py; until a worker registers "
                "the name, its jobs stay queued.",
            )
        ]
        assert isinstance(found[0], checks.Warning)

    def test_registered_payloads_have_no_warning(self):
        assert not [m for m in check_registry() if m.id == "jobs.W001" and "jobapp." in m.msg]


class TestDatabaseBounds:
    """The bounds on the worker's and the scheduler's own connections (jobs.db.bounds)."""

    @staticmethod
    def bounds_messages(jobs_setting) -> list[tuple[str, str, str | None]]:
        with override_settings(JOBS=jobs_setting):
            return [(m.id, m.msg, m.hint) for m in check_database_bounds()]

    def test_defaults_pass_and_the_check_is_registered(self):
        assert self.bounds_messages({}) == []
        assert check_database_bounds in checks.registry.registry.get_checks()

    @pytest.mark.parametrize(
        "key", ["DB_STATEMENT_TIMEOUT", "DB_LOCK_TIMEOUT", "DB_NETWORK_TIMEOUT"]
    )
    def test_zero_turns_a_bound_off_and_negative_is_e002(self, key):
        assert messages({key: 0}) == []
        assert self.bounds_messages({key: 0}) == []
        assert messages({key: -1}) == [
            (
                "jobs.E002",
                f"JOBS[{key!r}] must be zero or a positive duration, got -1.",
                "Give a datetime.timedelta or a number of seconds.",
            )
        ]

    def test_w022_a_statement_bound_not_shorter_than_the_leader_timeout(self):
        found = self.bounds_messages({"DB_STATEMENT_TIMEOUT": 10, "DB_LOCK_TIMEOUT": 12})
        hint = (
            "A scheduler statement that runs into this bound makes the leader step down (its "
            "loop has not moved for SCHEDULER_LEADER_TIMEOUT) instead of being cancelled and "
            "retried; keep it well below SCHEDULER_LEADER_TIMEOUT."
        )
        assert found == [
            (
                "jobs.W022",
                "JOBS['DB_STATEMENT_TIMEOUT'] (0:00:10) is not shorter than "
                "JOBS['SCHEDULER_LEADER_TIMEOUT'] (0:00:10).",
                hint,
            ),
            (
                "jobs.W022",
                "JOBS['DB_LOCK_TIMEOUT'] (0:00:12) is not shorter than "
                "JOBS['SCHEDULER_LEADER_TIMEOUT'] (0:00:10).",
                hint,
            ),
        ]
        with override_settings(JOBS={"DB_STATEMENT_TIMEOUT": 10}):
            assert [type(m) for m in check_database_bounds()] == [checks.Warning]
        assert (
            self.bounds_messages({"DB_STATEMENT_TIMEOUT": 10, "SCHEDULER_LEADER_TIMEOUT": 11}) == []
        )

    def test_e023_a_network_bound_under_a_second(self):
        assert self.bounds_messages({"DB_NETWORK_TIMEOUT": 0.5}) == [
            (
                "jobs.E023",
                "JOBS['DB_NETWORK_TIMEOUT'] (0:00:00.500000) is shorter than one second.",
                "TCP keepalive probes count whole seconds; use a few seconds, or 0 to leave "
                "the operating system's defaults.",
            )
        ]

    def test_invalid_values_are_left_to_e002(self):
        assert self.bounds_messages({"DB_STATEMENT_TIMEOUT": "5s", "DB_NETWORK_TIMEOUT": -1}) == []


class TestTaskBackendNeedsTheJobsApp:
    """E050: a TASKS backend pointing at jobs.backends.PostgresBackend while ``jobs`` is not
    in INSTALLED_APPS (its tasks would go to tables no migration made, to no worker)."""

    E050 = (
        "jobs.E050",
        "TASKS['default'] uses jobs.backends.PostgresBackend, but the jobs app is not installed.",
        "Add 'jobs' to INSTALLED_APPS and run migrate: the backend keeps its tasks in the "
        "jobs tables and manage.py runworker runs them.",
    )

    def test_the_backend_reports_the_missing_app(self):
        from django.tasks import task_backends

        with override_settings(INSTALLED_APPS=["django.contrib.contenttypes"]):
            found = [(m.id, m.msg, m.hint) for m in task_backends["default"].check()]

        assert found == [self.E050]

    def test_django_s_task_checks_report_it(self):
        """Django registers check_tasks (which asks every TASKS backend) with the system
        checks, so manage.py check reports E050."""
        from django.tasks.checks import check_tasks

        assert check_tasks in checks.registry.registry.get_checks()
        with override_settings(INSTALLED_APPS=["django.contrib.contenttypes"]):
            found = list(check_tasks())

        assert [(m.id, m.msg, m.hint, m.level) for m in found] == [(*self.E050, checks.ERROR)]

    def test_installed_it_is_quiet(self):
        from django.tasks import task_backends

        assert list(task_backends["default"].check()) == []
        assert not [m for m in checks.run_checks() if m.id == "jobs.E050"]
