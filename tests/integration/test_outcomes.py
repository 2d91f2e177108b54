"""Fenced outcomes: only the holder of the current claim token changes a job."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, Outcome
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db


def claim_one():
    [job] = queue.claim([ClaimRequest("test.noop.v1", 1)], scope=AllTenants())
    return job


def test_complete_records_success_and_result():
    JobFactory()
    job = claim_one()

    assert queue.complete(job, {"sent": 3}) is True

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.result, row.last_error, row.claim_token) == (
        "succeeded",
        {"sent": 3},
        "",
        None,
    )
    assert row.finished_at is not None and row.key_held


def test_retry_requeues_the_same_row_after_the_delay():
    JobFactory()
    job = claim_one()

    assert queue.retry(job, code="handler_error", detail="timeout", delay=timedelta(seconds=30))

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.attempts, row.last_error, row.error_detail) == (
        "queued",
        1,
        "handler_error",
        "timeout",
    )
    assert row.next_retry_at == row.run_after
    assert row.run_after > timezone.now() + timedelta(seconds=25)
    assert queue.claim([ClaimRequest("test.noop.v1", 1)], scope=AllTenants()) == []
    assert Job.objects.count() == 1


def test_retry_at_an_absolute_time():
    JobFactory()
    job = claim_one()
    at = timezone.now() + timedelta(hours=2)
    queue.retry(job, code="handler_error", at=at)
    assert Job.objects.get(pk=job.id).run_after == at


def test_fail_is_terminal_with_code_and_detail():
    JobFactory()
    job = claim_one()

    assert queue.fail(job, code="rejected", detail="user is gone")

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.last_error, row.error_detail) == ("failed", "rejected", "user is gone")


def test_release_hands_the_job_back_untried():
    JobFactory(last_error="handler_error")
    job = claim_one()

    report = queue.release([job])

    row = Job.objects.get(pk=job.id)
    assert report.applied == (job.id,)
    assert (row.state, row.attempts, row.last_error, row.claim_token) == (
        "queued",
        0,
        "handler_error",
        None,
    )
    assert claim_one().id == job.id


@pytest.mark.parametrize(
    "write",
    [
        lambda job: queue.complete(job),
        lambda job: queue.fail(job, code="handler_error"),
        lambda job: queue.retry(job, code="handler_error"),
    ],
    ids=["complete", "fail", "retry"],
)
def test_a_stale_token_changes_nothing(write):
    JobFactory()
    stale = claim_one()
    # The lease expired and another worker took the job: a new token.
    Job.objects.filter(pk=stale.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert [r.id for r in queue.requeue_expired()] == [stale.id]
    current = claim_one()
    before = Job.objects.values("state", "attempts", "claim_token", "last_error").get(pk=stale.id)

    assert write(stale) is False

    after = Job.objects.values("state", "attempts", "claim_token", "last_error").get(pk=stale.id)
    assert after == before
    assert after["claim_token"] == current.claim_token and after["attempts"] == 2


def test_batch_record_reports_applied_and_fenced():
    JobFactory.create_batch(3)
    a, b, c = queue.claim([ClaimRequest("test.noop.v1", 3)], scope=AllTenants())
    Job.objects.filter(pk=c.id).update(claim_token=None, state="queued", lease_expires_at=None)

    report = queue.record(
        [
            Outcome.succeeded(a),
            Outcome.retry(b, code="deadline_exceeded", delay=5),
            Outcome.succeeded(c),
        ]
    )

    assert report.applied == (a.id, b.id)
    assert report.fenced == (c.id,)
    states = dict(Job.objects.values_list("id", "state"))
    assert states == {a.id: "succeeded", b.id: "queued", c.id: "queued"}


def test_long_error_detail_is_truncated():
    JobFactory()
    job = claim_one()
    queue.fail(job, code="handler_error", detail="x" * 20000)
    assert len(Job.objects.get(pk=job.id).error_detail) == 8000


@pytest.mark.parametrize("path", ["record", "pass"])
def test_of_two_outcomes_for_one_attempt_the_later_is_written(path):
    """A batch may name one attempt twice (a flush sent again): the row is written once,
    with the later outcome's values, and the report counts both as applied."""
    JobFactory()
    job = claim_one()
    batch = [Outcome.succeeded(job, {"first": 1}), Outcome.failed(job, code="late", detail="x")]

    if path == "record":
        report = queue.record(batch)
    else:  # the worker's pass: the function with its kept plan
        report, _claimed = queue.record_and_claim(
            batch, [ClaimRequest("test.noop.v1", 1)], scope=AllTenants(), count=False
        )

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.last_error, row.error_detail, row.result) == (
        "failed",
        "late",
        "x",
        None,
    )
    assert report.applied == (job.id, job.id) and report.fenced == ()
