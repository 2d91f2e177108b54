"""Every transition of a bound job against its run row, fenced cases included.

The rule under test (jobs.queue.bound): a bound row moves only with its job, and only by the
process whose write to the jobs table was applied.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import enqueue, queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, Outcome, bound
from jobs.queue.bound import RunRow
from jobs.scheduler.watchdog import Watchdog
from jobs.testing import run_worker
from tests.runapp.jobs import DeliverV1
from tests.runapp.models import Delivery

pytestmark = pytest.mark.django_db(transaction=True)


def delivery(key: str) -> Delivery:
    return Delivery.objects.create(job_id=key)


def state(row: Delivery) -> tuple[str, str]:
    row.refresh_from_db()
    return row.state, row.last_error


def claim_one() -> queue.ClaimedJob:
    [job] = queue.claim([ClaimRequest(DeliverV1.job_name, 1)], scope=AllTenants())
    return job


def runs_of(job: queue.ClaimedJob, row: Delivery) -> dict:
    """The run row the worker names for ``job``, as it passes it to the queue's writes."""
    return {job.claim_token: RunRow(Delivery, row.pk)}


def test_success_retry_and_failure_move_the_row():
    ok, flaky, broken = delivery("ok"), delivery("flaky"), delivery("broken")
    enqueue(DeliverV1(run_id=ok.pk))
    enqueue(DeliverV1(run_id=flaky.pk, plan=("error", "ok")))
    enqueue(DeliverV1(run_id=broken.pk, plan=("error",)))

    with pytest.raises(AssertionError):  # JobFailed for the broken one
        run_worker()
    run_worker()

    assert state(ok) == ("succeeded", "")
    assert state(flaky) == ("succeeded", "")
    assert state(broken) == ("failed", "handler_error")
    broken.refresh_from_db()
    assert broken.attempts == 3 and broken.finished_at is not None


def test_a_fenced_release_leaves_the_new_owners_row_alone():
    row = delivery("fenced")
    enqueue(DeliverV1(run_id=row.pk))
    stale = claim_one()
    Delivery.objects.filter(pk=row.pk).update(state="running")
    # The stale worker's lease expired; another worker took the job and runs it.
    Job.objects.filter(pk=stale.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    queue.requeue_expired()
    owner = claim_one()

    # The stale worker hands back what it no longer holds.
    report = queue.release([stale], runs=runs_of(stale, row))
    assert report.fenced == (stale.id,)
    assert state(row) == ("running", "")

    assert queue.record([Outcome.succeeded(owner)], runs=runs_of(owner, row)).applied
    assert state(row) == ("succeeded", "")


def test_the_watchdog_leaves_a_bound_row_whose_job_is_active():
    row = delivery("orphan")
    done = enqueue(DeliverV1(run_id=row.pk))
    claim_one()  # a worker claims it and dies (kill -9): heartbeats stop, the lease expires
    long_ago = timezone.now() - timedelta(hours=1)
    Delivery.objects.filter(pk=row.pk).update(state="running", heartbeat_at=long_ago)
    Job.objects.filter(pk=done.id).update(lease_expires_at=long_ago)

    counts = Watchdog().run_once()

    assert counts["jobs.job:requeued"] == 1
    assert "runapp.delivery:stale" not in counts
    assert state(row) == ("running", "")
    run_worker()
    assert state(row) == ("succeeded", "")
    assert Job.objects.get(pk=done.id).state == "succeeded"


def test_the_watchdog_still_reaps_a_row_whose_job_is_finished():
    row = delivery("finished")
    done = enqueue(DeliverV1(run_id=row.pk))
    run_worker()
    Delivery.objects.filter(pk=row.pk).update(
        state="running", heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert Job.objects.get(pk=done.id).state == "succeeded"

    counts = Watchdog().run_once()

    assert counts["runapp.delivery:stale"] == 1
    assert state(row) == ("failed", "stale")


def test_replaying_the_job_replays_its_row():
    row = delivery("replayed")
    done = enqueue(DeliverV1(run_id=row.pk, plan=("error",)))
    with pytest.raises(AssertionError):
        run_worker()
    assert state(row) == ("failed", "handler_error")

    assert queue.replay([done.id], by="alice").replayed == (done.id,)
    assert state(row) == ("queued", "")
    # The cause was fixed (here: the payload's plan) before the replay runs.
    Job.objects.filter(pk=done.id).update(payload={"run_id": row.pk, "plan": ["ok"]})
    run_worker()

    assert state(row) == ("succeeded", "")


def test_cancelling_a_queued_job_cancels_its_row_and_frees_its_key():
    row = delivery("cancelled")
    done = enqueue(DeliverV1(run_id=row.pk), delay=timedelta(hours=1))
    Delivery.objects.filter(pk=row.pk).update(state="queued")

    assert queue.cancel([done.id], by="alice") == [done.id]

    assert state(row) == ("cancelled", "cancelled")
    Delivery.objects.create(job_id="cancelled")  # the active-state lock is free again


def test_a_shutdown_hand_back_queues_the_row():
    row = delivery("handed-back")
    job = claim_one() if enqueue(DeliverV1(run_id=row.pk)) else None
    Delivery.objects.filter(pk=row.pk).update(state="running")

    report = queue.release([job], runs=runs_of(job, row))

    assert report.applied == (job.id,)
    assert state(row)[0] == "queued"


NOOP = "test.noop.v1"


def claim(names=(NOOP,), limit=100, scope=None, worker="w1", caps=None):
    requests = [ClaimRequest(n, limit, (caps or {}).get(n)) for n in names]
    return queue.claim(requests, scope=scope or AllTenants(), worker=worker)


def row_of(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


def expire(job_id: int) -> None:
    row = row_of(job_id)
    Job.objects.filter(pk=job_id).update(lease_expires_at=row.started_at - timedelta(seconds=1))


@pytest.mark.django_db
def test_a_cancelled_bound_job_whose_lease_expired_ends_its_run_row_cancelled():
    row = Delivery.objects.create(job_id="expired-cancel")
    done = enqueue(DeliverV1(run_id=row.pk))
    [job] = claim((DeliverV1.job_name,))
    bound.started(RunRow(Delivery, row.pk), attempt=1)  # the handler thread's first step
    queue.cancel_running([job.id], by="alice")
    expire(job.id)  # the worker died

    counts = Watchdog().run_once()

    assert counts["jobs.job:requeued"] == 1
    assert row_of(done.id).state == "cancelled"
    row.refresh_from_db()
    assert (row.state, row.last_error) == ("cancelled", "cancelled")


@pytest.mark.django_db
@pytest.mark.parametrize("outcome", ["retry", "released"])
def test_a_cancelled_bound_jobs_retry_or_hand_back_ends_its_run_row_cancelled(outcome):
    """The worker's own sequence (the pass, the drain's hand-back): the queue writes the
    outcomes, then moves the run rows of those applied, as they were written."""
    row = Delivery.objects.create(job_id=f"cancel-{outcome}")
    enqueue(DeliverV1(run_id=row.pk))
    [job] = claim((DeliverV1.job_name,))
    bound.started(RunRow(Delivery, row.pk), attempt=1)
    queue.cancel_running([job.id], by="alice")  # before the worker's next renewal
    made = (
        Outcome.retry(job, code="handler_error", delay=60)
        if outcome == "retry"
        else Outcome.released(job)
    )

    # As the worker does: the run row follows the outcome as written (report.as_written).
    queue.record([made], runs={job.claim_token: RunRow(Delivery, row.pk)})

    assert row_of(job.id).state == "cancelled"
    row.refresh_from_db()
    assert row.state == "cancelled", (
        f"the run row is {row.state} (next_retry_at {row.next_retry_at})"
    )
