"""``manage.py runscheduler`` is thin: it validates, then delegates to the scheduler loop."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from jobs.management.commands.runscheduler import STOOD_BY
from jobs.models import Job, ScheduleSlot
from jobs.scheduler.leader import Leadership
from tests.runapp.models import QuickRun

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
    out = StringIO()
    call_command("runscheduler", "--once", stdout=out)
    assert out.getvalue() == "led: ran cron, watchdog, retention, archive, release, gauges\n"
    slots = ScheduleSlot.objects.filter(schedule="every-second")
    assert slots.count() == 1  # a new schedule's first tick fires only its current slot
    assert Job.objects.filter(name="jobapp.ping.v1").count() == 1


@override_settings(JOBS={"SCHEDULES": EVERY_SECOND})
def test_once_as_a_standby_does_nothing_and_says_so_with_its_own_status():
    holder = Leadership("holder")
    try:
        assert holder.try_acquire()
        with pytest.raises(CommandError) as raised:
            call_command("runscheduler", "--once")
    finally:
        holder.release()
    assert raised.value.returncode == STOOD_BY == 3
    assert str(raised.value) == "stood by: another scheduler leads; nothing was done"
    assert not ScheduleSlot.objects.exists()


@override_settings(JOBS={"SCHEDULES": EVERY_SECOND})
def test_once_reports_a_failed_duty_as_an_error():
    table = QuickRun._meta.db_table
    with connection.cursor() as cur:  # the watchdog's pass over this run table fails
        cur.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
    try:
        with pytest.raises(CommandError) as raised:
            call_command("runscheduler", "--once")
    finally:
        with connection.cursor() as cur:
            cur.execute(f"ALTER TABLE {table}_away RENAME TO {table}")
    assert raised.value.returncode == 1
    assert str(raised.value) == (
        "led, but watchdog failed (see the log); ran cron, retention, archive, release, gauges"
    )


@override_settings(JOBS={"SCHEDULES": {"x": {"cron": "* * *", "job": "jobapp.ping.v1"}}})
def test_invalid_schedules_are_a_command_error():
    with pytest.raises(CommandError, match=r"Invalid schedules:\n  - JOBS\['SCHEDULES'\]\['x'\]"):
        call_command("runscheduler", "--once")


def test_invalid_options_are_a_command_error():
    with pytest.raises(CommandError, match=r"tick interval must be positive, got 0\.0"):
        call_command("runscheduler", "--once", "--tick-interval", "0")
