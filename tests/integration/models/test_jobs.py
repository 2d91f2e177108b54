"""The jobs table's own rules: what the database refuses whoever writes the row."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from jobs import queue
from jobs.models import Job
from jobs.queue import NewJob

pytestmark = pytest.mark.django_db

NAME = "test.models.jobs.v1"


def test_only_a_job_that_waits_for_others_has_no_due_time():
    first = queue.enqueue(NewJob(NAME))
    waiting = queue.enqueue(NewJob(NAME, after=(first.id,)))
    assert Job.objects.get(pk=waiting.id).run_after is None
    with pytest.raises(IntegrityError, match="jobs_job_due_or_waiting"), transaction.atomic():
        Job.objects.filter(pk=first.id).update(run_after=None)  # it would never run
    with pytest.raises(IntegrityError, match="jobs_job_due_or_waiting"), transaction.atomic():
        Job.objects.filter(pk=waiting.id).update(waiting_on=0)  # nothing left to release it
