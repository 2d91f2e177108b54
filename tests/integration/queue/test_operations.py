"""Operator actions on queued jobs: cancel and run now (replay: control/test_replays.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db


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
