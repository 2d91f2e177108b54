"""``manage.py runscheduler`` is thin: it validates, then delegates to the scheduler loop."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from jobs.models import Job, ScheduleSlot
from jobs.scheduler.leader import Leadership

pytestmark = pytest.mark.django_db(transaction=True)

EVERY_SECOND = {
    "every-second": {
        "cron": "* * * * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "once"},
        "grace": 2,
    }
}


@override_settings(JOBS={"SCHEDULES": EVERY_SECOND})
def test_once_leads_runs_every_duty_and_exits():
    call_command("runscheduler", "--once")
    slots = ScheduleSlot.objects.filter(schedule="every-second")
    assert 1 <= slots.count() <= 3  # the slots inside the grace
    assert Job.objects.filter(name="jobapp.ping.v1").count() == slots.count()


@override_settings(JOBS={"SCHEDULES": EVERY_SECOND})
def test_once_as_a_standby_does_nothing():
    holder = Leadership("holder")
    try:
        assert holder.try_acquire()
        call_command("runscheduler", "--once")
    finally:
        holder.release()
    assert not ScheduleSlot.objects.exists()


@override_settings(JOBS={"SCHEDULES": {"x": {"cron": "* * *", "job": "jobapp.ping.v1"}}})
def test_invalid_schedules_are_a_command_error():
    with pytest.raises(CommandError, match=r"Invalid schedules:\n  - JOBS\['SCHEDULES'\]\['x'\]"):
        call_command("runscheduler", "--once")


def test_invalid_options_are_a_command_error():
    with pytest.raises(CommandError, match=r"tick interval must be positive, got 0\.0"):
        call_command("runscheduler", "--once", "--tick-interval", "0")
