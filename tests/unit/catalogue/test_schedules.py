"""Schedule definitions are validated whole at start-up, with clear messages. No database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from jobs import JobContext, Payload
from jobs.catalogue import schedules as schedules_module
from jobs.catalogue.registry import JobType, Registry
from jobs.catalogue.schedules import load_schedules, schedule, schedule_problems
from jobs.checks import check_scheduler_settings, check_schedules
from jobs.scheduler.config import SchedulerConfig


class ReportV1(Payload, name="schedtest.report.v1"):
    kind: str

    def validate(self) -> None:
        if self.kind not in ("daily", "weekly"):
            raise ValueError(f"unknown report kind {self.kind!r}")


class OtherV1(Payload, name="schedtest.other.v1"):
    n: int = 0


def handler(payload: Payload, ctx: JobContext) -> None:
    return None


REGISTRY = Registry([JobType(ReportV1, handler), JobType(OtherV1, handler)])
NIGHTLY = {"cron": "0 3 * * *", "job": "schedtest.report.v1", "payload": {"kind": "daily"}}


def problems(configured=None, declared=()) -> list[str]:
    return schedule_problems(configured or {}, declared, REGISTRY)


class TestDefinitions:
    def test_a_valid_schedule_with_its_defaults(self):
        (nightly,) = load_schedules({"nightly": NIGHTLY}, [], REGISTRY)
        assert nightly.name == "nightly"
        assert nightly.payload == ReportV1(kind="daily")
        assert nightly.job == "schedtest.report.v1"
        assert nightly.timezone == ZoneInfo("UTC")  # settings.TIME_ZONE
        assert (nightly.misfire, nightly.max_catch_up, nightly.tenant) == ("skip", 10, None)
        assert nightly.misfire_grace == timedelta(seconds=60)
        assert nightly.catch_up_from is None  # the first tick fires only the current slot

    def test_every_option(self):
        spec = {
            **NIGHTLY,
            "misfire": "all",
            "timezone": "Europe/Berlin",
            "max_catch_up": 24,
            "tenant": "acme",
            "grace": 300,
            "catch_up_from": "2026-01-01T00:00",
        }
        (nightly,) = load_schedules({"nightly": spec}, [], REGISTRY)
        assert nightly.timezone == ZoneInfo("Europe/Berlin")
        # Naive means the schedule's own time zone, as for its cron expression.
        assert nightly.catch_up_from == datetime(2026, 1, 1, tzinfo=ZoneInfo("Europe/Berlin"))
        assert (nightly.misfire, nightly.max_catch_up, nightly.tenant) == ("all", 24, "acme")
        assert nightly.misfire_grace == timedelta(minutes=5)

    def test_the_job_id_names_the_schedule_and_the_slot_in_utc(self):
        (nightly,) = load_schedules(
            {"nightly": {**NIGHTLY, "timezone": "Europe/Berlin"}}, [], REGISTRY
        )
        slot = datetime(2024, 3, 31, 3, tzinfo=ZoneInfo("Europe/Berlin"))
        assert nightly.job_id(slot) == "cron:nightly:2024-03-31T01:00:00Z"
        assert nightly.job_id(slot.astimezone(UTC)) == nightly.job_id(slot)

    def test_every_problem_is_reported_at_once_with_its_schedule(self):
        configured = {
            "bad-cron": {**NIGHTLY, "cron": "61 * * * *"},
            "bad-zone": {**NIGHTLY, "timezone": "Mars/Olympus"},
            "unknown-job": {"cron": "0 * * * *", "job": "nobody.registers.v1"},
            "bad-payload": {**NIGHTLY, "payload": {"kind": "hourly"}},
            "wrong-type": {**NIGHTLY, "payload": {"kind": 5}},
            "bad-policy": {**NIGHTLY, "misfire": "later", "max_catch_up": 0},
            "typo": {**NIGHTLY, "timezon": "UTC"},
            "bad tenant": {**NIGHTLY, "tenant": "a b"},
            "bad-start": {**NIGHTLY, "catch_up_from": "yesterday"},
        }
        assert problems(configured) == [
            "JOBS['SCHEDULES']['bad-cron']: cron '61 * * * *' is not a valid cron expression",
            "JOBS['SCHEDULES']['bad-zone']: timezone 'Mars/Olympus' is not a known IANA time zone",
            "JOBS['SCHEDULES']['unknown-job']: job type 'nobody.registers.v1' is not registered "
            "(register it with @job in <app>/jobs.py)",
            "JOBS['SCHEDULES']['bad-payload']: invalid payload for schedtest.report.v1: "
            "unknown report kind 'hourly'",
            "JOBS['SCHEDULES']['wrong-type']: invalid payload for schedtest.report.v1: "
            "kind: expected str, got int",
            "JOBS['SCHEDULES']['bad-policy']: misfire must be one of skip, once, all, got 'later'",
            "JOBS['SCHEDULES']['bad-policy']: max_catch_up must be a whole number from 1 to "
            "1000, got 0",
            "JOBS['SCHEDULES']['typo']: unknown option 'timezon' (options: catch_up_from, cron, "
            "grace, job, max_catch_up, misfire, payload, tenant, timezone)",
            "JOBS['SCHEDULES']['bad tenant']: the schedule name must be 1-64 characters of "
            "letters, digits, '_', '.', ':' or '-' starting with a letter or digit, "
            "got 'bad tenant'",
            "JOBS['SCHEDULES']['bad tenant']: tenant must be 1-64 characters of letters, digits, "
            "'_', '.', ':' or '-' starting with a letter or digit, got 'a b'",
            "JOBS['SCHEDULES']['bad-start']: catch_up_from must be a datetime or an ISO 8601 "
            "date and time, e.g. '2026-01-01T00:00:00+00:00', got 'yesterday'",
        ]

    def test_load_refuses_to_start_listing_the_problems(self):
        with pytest.raises(ImproperlyConfigured) as caught:
            load_schedules({"nightly": {**NIGHTLY, "cron": "0 0 30 2 *"}}, [], REGISTRY)
        assert str(caught.value) == (
            "Invalid schedules:\n  - JOBS['SCHEDULES']['nightly']: cron '0 0 30 2 *' never fires"
        )

    def test_schedules_must_be_a_dict(self):
        assert problems(["nightly"]) == [
            "JOBS['SCHEDULES'] must be a dict of schedules by name, got ['nightly']"
        ]


class TestDeclaredInCode:
    def test_declared_next_to_the_job_type(self, monkeypatch):
        declared: list = []
        monkeypatch.setattr(schedules_module, "_declared", declared)
        schedule("weekly", "0 6 * * 1", ReportV1(kind="weekly"), misfire="once", timezone="UTC")
        assert declared == [
            (
                __name__,
                "weekly",
                {
                    "cron": "0 6 * * 1",
                    "payload": ReportV1(kind="weekly"),
                    "misfire": "once",
                    "max_catch_up": 10,
                    "timezone": "UTC",
                },
            )
        ]
        (weekly,) = load_schedules({}, declared, REGISTRY)
        assert (weekly.job, weekly.payload, weekly.misfire) == (
            "schedtest.report.v1",
            ReportV1(kind="weekly"),
            "once",
        )

    def test_a_name_used_twice_is_refused(self):
        declared = [("shop.jobs", "nightly", {"cron": "0 3 * * *", "payload": OtherV1()})]
        assert problems({"nightly": NIGHTLY}, declared) == [
            "schedule 'nightly' declared in shop.jobs: the name is already used by "
            "JOBS['SCHEDULES']['nightly']"
        ]

    def test_an_invalid_payload_value_is_refused(self):
        declared = [("shop.jobs", "bad", {"cron": "0 3 * * *", "payload": ReportV1(kind="x")})]
        assert problems({}, declared) == [
            "schedule 'bad' declared in shop.jobs: invalid payload for schedtest.report.v1: "
            "unknown report kind 'x'"
        ]


class TestSystemChecks:
    def test_e020_reports_each_invalid_schedule(self):
        bad = {"hourly": {"cron": "0 * * * *", "job": "nobody.registers.v1"}}
        with override_settings(JOBS={"SCHEDULES": bad}):
            messages = [(m.id, m.msg, m.hint) for m in check_schedules()]
        assert messages == [
            (
                "jobs.E020",
                "Invalid schedule: JOBS['SCHEDULES']['hourly']: job type 'nobody.registers.v1' "
                "is not registered (register it with @job in <app>/jobs.py).",
                "See docs/scheduler.md for the schedule options.",
            )
        ]

    def test_valid_schedules_pass(self):
        good = {
            "ping": {"cron": "*/5 * * * *", "job": "jobapp.ping.v1", "payload": {"message": "hi"}}
        }
        with override_settings(JOBS={"SCHEDULES": good}):
            assert check_schedules() == []

    def test_e021_leader_timeout_under_a_second(self):
        with override_settings(JOBS={"SCHEDULER_LEADER_TIMEOUT": 0.5}):
            messages = [(m.id, m.msg) for m in check_scheduler_settings()]
        assert messages == [
            (
                "jobs.E021",
                "JOBS['SCHEDULER_LEADER_TIMEOUT'] (0:00:00.500000) is shorter than one second.",
            )
        ]


class TestSchedulerConfig:
    def test_defaults(self):
        config = SchedulerConfig()
        assert (config.tick_interval, config.watchdog_interval) == (1.0, 30.0)
        assert config.leader_duration == timedelta(seconds=10)

    def test_invalid_values_are_all_reported(self):
        with pytest.raises(ImproperlyConfigured) as caught:
            SchedulerConfig(tick_interval=0, retention_interval=-1, http_port=70000)
        assert str(caught.value) == (
            "invalid scheduler configuration: tick interval must be positive, got 0; "
            "retention interval must be positive, got -1; "
            "HTTP port must be from 0 to 65535, got 70000"
        )

    def test_a_tick_slower_than_a_schedules_grace_is_refused(self):
        (nightly,) = load_schedules({"nightly": {**NIGHTLY, "grace": 2}}, [], REGISTRY)
        with pytest.raises(ImproperlyConfigured, match="shorter than the misfire grace"):
            SchedulerConfig(tick_interval=5).check_schedules([nightly])
