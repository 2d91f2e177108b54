"""Retention deletes terminal rows past their age, in bounded batches, and nothing else; the
archive duty keeps the history ready ahead of the rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from jobs.db.clock import database_now
from jobs.models import Job, ScheduleSlot
from jobs.queue import history
from jobs.scheduler.retention import Archive, Retention, RetentionConfig
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
# The defaults: SUCCEEDED_RETENTION, FAILED_RETENTION, CANCELLED_RETENTION, SLOT_RETENTION.
AGES = {"succeeded": timedelta(hours=24), "failed": timedelta(days=14), "cancelled": timedelta(7)}


@pytest.fixture
def now():
    return database_now()


def finished(state: str, at) -> Job:
    return JobFactory(state=state, attempts=1, finished_at=at, key_held=False)


def slot(schedule: str, at) -> ScheduleSlot:
    return ScheduleSlot.objects.create(
        schedule=schedule, slot=at, kind="on_time", job_id=f"cron:{schedule}:{at.isoformat()}"
    )


def test_terminal_rows_past_their_retention_go_and_everything_else_stays(now):
    doomed, kept = [], []
    for state, age in AGES.items():
        doomed.append(finished(state, now - age - MINUTE))
        kept.append(finished(state, now - age + MINUTE))
    kept.append(JobFactory(state="queued"))
    kept.append(JobFactory(running=True))
    Job.objects.filter(pk__in=[j.pk for j in kept[-2:]]).update(created_at=now - timedelta(99))
    # A failed job older than the succeeded retention is still inside its own.
    kept.append(finished("failed", now - timedelta(days=2)))

    counts = Retention().run_once(now)

    assert counts == {"jobs.job:succeeded": 1, "jobs.job:failed": 1, "jobs.job:cancelled": 1}
    assert set(Job.objects.values_list("pk", flat=True)) == {j.pk for j in kept}


def test_old_slots_go_but_each_schedules_latest_slot_stays(now):
    age = timedelta(days=30)
    old = [slot("a", now - age - timedelta(days=1)), slot("a", now - age - MINUTE)]
    young = slot("a", now - age + MINUTE)
    only = slot("b", now - timedelta(days=90))  # b's latest: where its next tick starts

    counts = Retention().run_once(now)

    assert counts == {"jobs.scheduleslot:recorded": len(old)}
    assert set(ScheduleSlot.objects.values_list("pk", flat=True)) == {young.pk, only.pk}


def test_batches_are_bounded(now):
    for _ in range(5):
        finished("succeeded", now - timedelta(days=2))
    retention = Retention(RetentionConfig(batch_size=2, max_batches=1))
    assert retention.run_once(now) == {"jobs.job:succeeded": 2}
    assert retention.run_once(now) == {"jobs.job:succeeded": 2}
    assert retention.run_once(now) == {"jobs.job:succeeded": 1}
    assert retention.run_once(now) == {}


def test_finished_batches_go_after_their_retention(now):
    from jobs.models import Batch
    from jobs.queue import batches

    old = batches.open(None)
    batches.seal(old)  # no members: finished at once
    Batch.objects.filter(pk=old).update(fired_at=now - timedelta(days=14) - MINUTE)
    young = batches.open(None)
    batches.seal(young)

    counts = Retention().run_once(now)

    assert counts == {"jobs.batch:finished": 1}
    assert set(Batch.objects.values_list("pk", flat=True)) == {young}


def test_the_archive_duty_keeps_the_history_ready_ahead_as_time_passes(now):
    """Each archive pass makes the history ready for rows finishing in the hours ahead, so the
    worker's pass can write them there, and moves ``until`` on as time passes."""
    duty = Archive()
    readiness = []
    for hours in (0, 1, 2, 30):
        at = now + timedelta(hours=hours)
        duty.run_once(at)
        with connection.cursor() as cur:
            cur.execute(f"SELECT {history.READY_UNTIL.format(state='%s')}", ["succeeded"])
            (until,) = cur.fetchone()
        assert until - at >= 2 * HOUR, hours  # succeeded rows: hourly partitions
        readiness.append(until)
    assert readiness == sorted(readiness) and len(set(readiness)) == len(readiness)
