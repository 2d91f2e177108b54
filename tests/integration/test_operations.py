"""Operator actions: replay, cancel, run now."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import NewJob
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db


def test_replay_requeues_a_failed_job_with_fresh_attempts():
    failed = JobFactory(failed=True, attempts=5)

    report = queue.replay([failed.pk], by="alice")

    assert report.replayed == (failed.pk,)
    row = Job.objects.get(pk=failed.pk)
    assert (row.state, row.attempts, row.replayed_by, row.key_held) == ("queued", 0, "alice", True)
    assert row.replayed_at is not None and row.finished_at is None
    assert row.last_error == "handler_error"  # why it failed, until it runs again


def test_replay_leaves_active_and_succeeded_jobs_alone():
    queued = JobFactory()
    done = JobFactory(succeeded=True)
    report = queue.replay([queued.pk, done.pk], by="alice")
    assert report.replayed == () and report.not_failed == (queued.pk, done.pk)


def test_replay_after_the_key_was_taken_by_new_work_is_refused():
    old = JobFactory(job_id="k", failed=True, key_held=False)
    new = queue.enqueue(NewJob("test.noop.v1", job_id="k"))

    report = queue.replay([old.pk], by="alice")

    assert report.key_taken == (old.pk,)
    assert Job.objects.get(pk=old.pk).state == "failed"
    assert Job.objects.get(pk=new.id).state == "queued"


def test_replay_takes_the_key_back_from_an_expired_holder():
    old = JobFactory(job_id="k", failed=True, key_held=False)
    newer = JobFactory(job_id="k", succeeded=True, finished_at=timezone.now() - timedelta(days=2))

    assert queue.replay([old.pk], by="alice").replayed == (old.pk,)
    assert Job.objects.get(pk=newer.pk).key_held is False


def test_replay_of_two_failed_rows_sharing_a_key_replays_one():
    first = JobFactory(job_id="k", failed=True, key_held=False)
    second = JobFactory(job_id="k", failed=True, key_held=False)

    report = queue.replay([first.pk, second.pk], by="alice")

    assert report.replayed == (first.pk,)
    assert report.key_taken == (second.pk,)


@pytest.mark.django_db(transaction=True)
def test_two_operators_replaying_at_once_replay_once(threads):
    failed = JobFactory(failed=True)

    reports = threads(2, lambda i: queue.replay([failed.pk], by=f"operator-{i}"))

    assert sorted(len(r.replayed) for r in reports) == [0, 1]
    assert Job.objects.get(pk=failed.pk).state == "queued"


def test_cancel_only_touches_queued_jobs():
    queued = JobFactory()
    running = JobFactory(running=True)
    assert queue.cancel([queued.pk, running.pk], by="bob") == [queued.pk]
    row = Job.objects.get(pk=queued.pk)
    assert (row.state, row.key_held, row.error_detail) == ("cancelled", False, "cancelled by bob")


def test_run_now_makes_a_delayed_job_due():
    delayed = JobFactory(run_after=timezone.now() + timedelta(hours=1))
    due = JobFactory()
    assert queue.run_now([delayed.pk, due.pk]) == [delayed.pk]
    assert Job.objects.get(pk=delayed.pk).run_after <= timezone.now()
