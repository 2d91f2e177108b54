"""A job type bound to a run table: the worker keeps the domain row in step with the job."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs import JobContext, Payload, Reject, enqueue
from jobs.catalogue.registry import Backoff, JobType, Policy, Registry
from jobs.testing import JobFailed, run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.runapp.models import Delivery
from tests.support.polling import wait_for
from tests.support.worker import FAST_BACKOFF

pytestmark = pytest.mark.django_db(transaction=True)


class SendV1(Payload, name="test.bound_send.v1"):
    run_id: int
    plan: tuple[str, ...] = ("ok",)
    seconds: float = 0.0


seen: list[tuple[str, int]] = []


def send(payload: SendV1, ctx: JobContext) -> None:
    row = Delivery.objects.get(pk=payload.run_id)
    seen.append((row.state, row.attempts))
    action = payload.plan[min(ctx.attempt, len(payload.plan)) - 1]
    if action == "error":
        raise ConnectionError("smtp down")
    if action == "reject":
        raise Reject("mailbox does not exist")
    if action == "slow":
        ctx.sleep(payload.seconds)


def bound_registry(**policy) -> Registry:
    options = {"run_model": Delivery, "max_attempts": 3, "backoff": FAST_BACKOFF, **policy}
    return Registry([JobType(SendV1, send, Policy(**options))])


@pytest.fixture(autouse=True)
def _reset():
    seen.clear()


def test_the_row_runs_and_succeeds_with_the_job():
    row = Delivery.objects.create(job_id="d-1")
    enqueue(SendV1(run_id=row.pk))

    run_worker(registry=bound_registry())

    row.refresh_from_db()
    assert seen == [("running", 1)]
    assert (row.state, row.attempts, row.last_error) == ("succeeded", 1, "")
    assert row.heartbeat_at is not None and row.finished_at is not None


def test_a_retry_puts_the_row_back_to_queued_with_its_next_retry():
    row = Delivery.objects.create(job_id="d-2")
    enqueue(SendV1(run_id=row.pk, plan=("error", "ok")))
    hour = Backoff(base=timedelta(hours=1), cap=timedelta(hours=1))

    run_worker(registry=bound_registry(backoff=hour))  # the retry is not due before the deadline

    row.refresh_from_db()
    assert (row.state, row.attempts, row.last_error) == ("queued", 1, "handler_error")
    assert "ConnectionError: smtp down" in row.error_detail
    assert row.next_retry_at is not None and row.next_retry_at > row.heartbeat_at


def test_the_next_attempt_runs_the_row_again_and_clears_the_retry():
    row = Delivery.objects.create(job_id="d-5")
    enqueue(SendV1(run_id=row.pk, plan=("error", "ok")))

    run_worker(registry=bound_registry())

    row.refresh_from_db()
    assert seen == [("running", 1), ("running", 2)]
    assert (row.state, row.attempts, row.next_retry_at, row.last_error) == (
        "succeeded",
        2,
        None,
        "",
    )


def test_a_terminal_failure_fails_the_row_with_its_cause():
    row = Delivery.objects.create(job_id="d-3")
    enqueue(SendV1(run_id=row.pk, plan=("reject",)))

    with pytest.raises(JobFailed):
        run_worker(registry=bound_registry())

    row.refresh_from_db()
    assert (row.state, row.last_error) == ("failed", "rejected")
    assert "mailbox does not exist" in row.error_detail
    assert row.finished_at is not None


def test_lease_renewals_stamp_the_rows_heartbeat():
    row = Delivery.objects.create(job_id="d-4")
    enqueue(SendV1(run_id=row.pk, plan=("slow",), seconds=5))
    worker = Worker(
        bound_registry(),
        WorkerConfig(lease=timedelta(seconds=0.3), install_signal_handlers=False),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        first = wait_for(lambda: Delivery.objects.get(pk=row.pk).heartbeat_at)
        later = wait_for(lambda: _newer(row.pk, first))
    finally:
        worker.request_stop(force=True)
        thread.join(10)
    assert later > first
    row.refresh_from_db()
    assert row.state == "queued"  # handed back at shutdown, like its job


def test_the_registry_refuses_a_binding_it_cannot_follow():
    with pytest.raises(ImproperlyConfigured, match="run_field 'delivery_id' is not a field"):
        bound_registry(run_field="delivery_id")
    with pytest.raises(ImproperlyConfigured, match="run_model must be a concrete RunContract"):
        bound_registry(run_model=dict)


def _newer(pk: int, than):
    beat = Delivery.objects.get(pk=pk).heartbeat_at
    return beat if beat and beat > than else None
