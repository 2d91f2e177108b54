"""Effect keys, the effect journal and transactional completion, on real PostgreSQL.

The journal's writes commit on their own (``run()`` refuses an open transaction) and the
worker must see committed rows, so these are ``transaction=True`` tests.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection, transaction
from django.db.models import Sum
from django.db.transaction import TransactionManagementError

import jobs
from jobs import JobContext, LeaseLost, Payload, enqueue, queue
from jobs.api.effects import key_for
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.db.clock import database_now
from jobs.models import Effect, Job, JobHistory, Rollup, TenantOverride
from jobs.queue import AllTenants, ClaimedJob, ClaimRequest, NewJob, history
from jobs.queue import effects as journal
from jobs.scheduler.retention import Retention
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.support.concurrency import waiting_on_a_lock
from tests.support.factories import JobFactory
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

NOOP = "test.noop.v1"


def claim() -> ClaimedJob:
    [job] = queue.claim([ClaimRequest(NOOP, 1)], scope=AllTenants())
    return job


def context(job: ClaimedJob) -> JobContext:
    return JobContext(
        id=job.id,
        job_id=job.job_id,
        name=job.name,
        tenant=job.tenant,
        attempt=job.attempts,
        max_attempts=job.max_attempts,
        timeout=10.0,
        logger=logging.LoggerAdapter(logging.getLogger("tests.effects"), {}),
        claim_token=job.claim_token,
    )


def next_attempt(job: ClaimedJob) -> ClaimedJob:
    """The attempt after ``job``'s: it ended in a retry, and the row is claimed again."""
    assert queue.retry(job, code="handler_error", detail="crashed mid-call")
    return claim()


class Calls:
    """A pretend provider call: counts the calls and the keys they carried."""

    def __init__(self, result=None, error: Exception | None = None) -> None:
        self.keys: list[str] = []
        self.result = result
        self.error = error

    def __call__(self, key: str):
        self.keys.append(key)
        if self.error is not None:
            raise self.error
        return self.result


# -- effect keys ------------------------------------------------------------------------


def test_the_key_is_the_same_on_every_attempt_and_differs_by_step_and_row():
    first_row = JobFactory(job_id="same")
    job = claim()
    ctx = context(job)
    key = jobs.effect_key(ctx, "charge")
    created = Job.objects.get(pk=job.id).created_at
    assert key == key_for(job.id, created, "charge") == str(uuid.UUID(key))
    assert len(key) <= 64
    second = next_attempt(job)
    assert jobs.effect_key(context(second), "charge") == key
    assert jobs.effect_key(ctx, "refund") != key

    queue.fail(second, code="rejected")
    Job.objects.filter(pk=job.id).update(key_held=False)  # its failure window has passed
    JobFactory(job_id="same")
    again = claim()
    assert again.id != first_row.id
    assert jobs.effect_key(context(again), "charge") != key


def test_a_step_name_must_be_short_text():
    JobFactory()
    ctx = context(claim())
    for bad in ("", "x" * 201, 7):
        with pytest.raises(ValueError, match="step must be 1-200"):
            jobs.effect_key(ctx, bad)  # type: ignore[arg-type]


# -- the journal ------------------------------------------------------------------------


def test_the_intent_commits_before_the_call_and_the_result_after():
    JobFactory()
    ctx = context(claim())
    seen = []

    def call(key: str):
        [row] = Effect.objects.filter(job=ctx.id)
        seen.append((row.state, row.key == key, row.attempt, row.finished_at))
        return {"charge": "ch_1", "amount": 250}

    assert jobs.effect(ctx, "charge").run(call) == {"charge": "ch_1", "amount": 250}
    assert seen == [("intent", True, 1, None)]
    row = Effect.objects.get(job=ctx.id, step="charge")
    assert (row.state, row.result, row.attempt) == ("done", {"charge": "ch_1", "amount": 250}, 1)
    assert row.key == jobs.effect_key(ctx, "charge") and row.finished_at is not None


def test_a_recorded_result_is_returned_without_calling_again():
    JobFactory()
    job = claim()
    jobs.effect(context(job), "charge").run(Calls(("ch_1", 250)))
    again = Calls("never")

    result = jobs.effect(context(next_attempt(job)), "charge").run(again)

    assert result == ["ch_1", 250]  # as stored: the first run returned the same
    assert again.keys == []


def test_an_intent_left_by_a_failed_call_is_reconciled_instead_of_called():
    JobFactory()
    job = claim()
    first = Calls(error=TimeoutError("no answer from the provider"))
    with pytest.raises(TimeoutError):
        jobs.effect(context(job), "charge").run(first)
    assert Effect.objects.get(job=job.id).state == "intent"

    ctx = context(next_attempt(job))
    again, asked = Calls("never"), []

    def reconcile(key: str):
        asked.append(key)
        return {"charge": "ch_1"}

    assert jobs.effect(ctx, "charge").run(again, reconcile=reconcile) == {"charge": "ch_1"}
    assert again.keys == [] and asked == first.keys
    row = Effect.objects.get(job=job.id)
    assert (row.state, row.result, row.attempt) == ("done", {"charge": "ch_1"}, 2)


@pytest.mark.parametrize("reconciled", [True, False], ids=["nothing-found", "no-reconcile"])
def test_an_intent_whose_call_did_not_happen_is_called_again_with_the_same_key(reconciled):
    JobFactory()
    job = claim()
    first = Calls(error=ConnectionError("refused"))
    with pytest.raises(ConnectionError):
        jobs.effect(context(job), "charge").run(first)

    again = Calls({"charge": "ch_2"})
    result = jobs.effect(context(next_attempt(job)), "charge").run(
        again, reconcile=(lambda key: None) if reconciled else None
    )

    assert result == {"charge": "ch_2"}
    assert again.keys == first.keys
    assert Effect.objects.get(job=job.id).attempt == 2


def test_a_stale_attempt_records_nothing():
    JobFactory()
    job = claim()
    stale = context(job)
    held = next_attempt(job)  # the lease was lost; the row is another attempt's
    calls = Calls("x")

    with pytest.raises(LeaseLost, match="was not started"):
        jobs.effect(stale, "charge").run(calls)
    assert calls.keys == [] and not Effect.objects.exists()

    def lease_lost_meanwhile(key: str):
        assert queue.retry(held, code="handler_error")
        return "made"

    with pytest.raises(LeaseLost, match="its result was not recorded"):
        jobs.effect(context(held), "charge").run(lease_lost_meanwhile)
    row = Effect.objects.get(job=job.id)
    assert (row.state, row.result, row.attempt) == ("intent", None, 2)


def test_run_refuses_an_open_transaction():
    JobFactory()
    ctx = context(claim())
    with transaction.atomic(), pytest.raises(TransactionManagementError, match="outside"):
        jobs.effect(ctx, "charge").run(Calls("x"))
    assert not Effect.objects.exists()


def test_arun_awaits_the_call_and_journals_it():
    JobFactory()
    ctx = context(claim())
    keys = []

    async def call(key: str):
        keys.append(key)
        return {"sent": True}

    async def main():
        first = await jobs.effect(ctx, "notify").arun(call)
        second = await jobs.effect(ctx, "notify").arun(call)
        return first, second

    # Its thread-sensitive writes run on this thread, with this test's connection.
    assert async_to_sync(main)() == ({"sent": True}, {"sent": True})
    assert keys == [jobs.effect_key(ctx, "notify")]


def test_retention_deletes_the_journal_of_jobs_gone_and_only_those():
    JobFactory()
    live = claim()
    jobs.effect(context(live), "charge").run(Calls(1))
    JobFactory()
    gone = claim()
    jobs.effect(context(gone), "charge").run(Calls(2))
    jobs.effect(context(gone), "mail").run(Calls(3))
    Job.objects.filter(pk=gone.id).delete()  # as the archive or prune pass would
    later = Effect.objects.get(job=gone.id, step="charge").started_at + timedelta(hours=1)

    assert journal.prune(older_than=timedelta(hours=2), now=later) == 0  # too young to look at
    assert journal.prune(older_than=timedelta(minutes=30), now=later, batch_size=1) == 2
    assert list(Effect.objects.values_list("job", flat=True)) == [live.id]


def test_the_journal_follows_its_job_into_the_history_and_goes_with_its_partition():
    [enqueued] = queue.enqueue_many([NewJob(NOOP)])  # keyless: archived once it finishes
    job = claim()
    jobs.effect(context(job), "charge").run(Calls({"charge": 1}))
    assert queue.complete(job)
    now = database_now()

    assert history.archive(now=now + timedelta(minutes=1)) == {"succeeded": (1, 1)}
    assert Retention().run_once(now=now + timedelta(days=1))["jobs.effect:gone"] == 0
    assert Effect.objects.filter(job=enqueued.id).exists()  # a replay would still find it

    counts = Retention().run_once(now=now + timedelta(days=400))  # its partition dropped
    assert not JobHistory.objects.filter(pk=enqueued.id).exists()
    assert counts["jobs.effect:gone"] == 1 and not Effect.objects.exists()


# -- transactional completion -------------------------------------------------------------


class Finish(Payload, name="test.effects.finish.v1"):
    """What the completing handler does: see ``finish``."""

    action: str = "commit"
    linger: float = 0.0


class Seen:
    def __init__(self) -> None:
        self.cancelled_after_commit: list[bool] = []
        self.errors: list[BaseException] = []
        self.started, self.go = threading.Event(), threading.Event()


def business(ctx: JobContext) -> str:
    return f"paid-{ctx.id}"


def finish(seen: Seen):
    def handle(payload: Finish, ctx: JobContext):
        action = payload.action
        if action == "outside":
            jobs.complete(ctx)
        if action == "stale":  # the test takes the job away meanwhile
            seen.started.set()
            assert seen.go.wait(10)
        try:
            with transaction.atomic():
                TenantOverride.objects.create(tenant=business(ctx), component="x")
                jobs.complete(ctx, {"paid": ctx.attempt})
                if action in ("rollback", "caught"):
                    raise RuntimeError("the business rule said no, after complete()")
        except LeaseLost as exc:
            seen.errors.append(exc)
            raise
        except RuntimeError:
            if action == "rollback":
                raise
            return "the handler's own outcome"  # caught: the worker writes this
        if payload.linger:  # past a lease renewal, with the job completed
            ctx.sleep(payload.linger)
            seen.cancelled_after_commit.append(ctx.cancelled.is_set())
        return "ignored: the job is completed already"

    return handle


def finish_async(seen: Seen):
    sync = finish(seen)

    async def handle(payload: Finish, ctx: JobContext):
        return await sync_to_async(sync)(payload, ctx)

    return handle


def run_until_finished(handler, *ids: int, lease: float = 10.0) -> Worker:
    registry = Registry(
        [JobType(Finish, handler, Policy(timeout=timedelta(seconds=10), max_attempts=1))]
    )
    worker = Worker(
        registry,
        WorkerConfig(
            concurrency=2,
            poll_interval=0.05,
            maintenance_interval=0.5,
            shutdown_timeout=1.0,
            install_signal_handlers=False,
            lease=timedelta(seconds=lease),
        ),
    )
    deadline = time.monotonic() + 15

    def done(w: Worker) -> bool:
        states = set(Job.objects.filter(pk__in=ids).values_list("state", flat=True))
        return (w.idle and states <= {"succeeded", "failed"}) or time.monotonic() > deadline

    worker.run(until=done)
    return worker


def succeeded_count(name: str) -> int:
    total = Rollup.objects.filter(name=name, outcome="succeeded").aggregate(n=Sum("count"))["n"]
    return total or 0


@pytest.mark.parametrize("handler", [finish, finish_async], ids=["sync", "async"])
def test_the_business_write_and_succeeded_commit_together_and_nothing_else_is_written(
    handler, caplog
):
    seen = Seen()
    job = enqueue(Finish(linger=0.5))
    with caplog.at_level(logging.DEBUG, logger="jobs"):
        run_until_finished(handler(seen), job.id, lease=0.6)  # renewed every 0.2 s meanwhile

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.result, row.attempts, row.claim_token) == (
        "succeeded",
        {"paid": 1},
        1,
        None,
    )
    assert TenantOverride.objects.filter(tenant=f"paid-{job.id}").exists()
    assert seen.cancelled_after_commit == [False], "a renewal reported the completed job lost"
    actions = {getattr(record, "action", None) for record in caplog.records}
    assert not actions & {"fenced", "lease_lost"}
    assert "succeeded" in caplog.text  # the worker still logs and counts the outcome
    assert succeeded_count(Finish.job_name) == 1  # counted once, by the worker


def test_a_rolled_back_completion_leaves_neither_and_the_worker_records_the_failure():
    job = enqueue(Finish(action="rollback"))
    run_until_finished(finish(Seen()), job.id)

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.last_error, row.result) == ("failed", "handler_error", None)
    assert "the business rule said no" in row.error_detail
    assert not TenantOverride.objects.filter(tenant=f"paid-{job.id}").exists()


def test_a_rolled_back_completion_then_a_normal_return_succeeds_as_usual():
    job = enqueue(Finish(action="caught"))
    run_until_finished(finish(Seen()), job.id)

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.result) == ("succeeded", "the handler's own outcome")
    assert not TenantOverride.objects.filter(tenant=f"paid-{job.id}").exists()


def test_complete_outside_a_transaction_is_an_error():
    job = enqueue(Finish(action="outside"))
    run_until_finished(finish(Seen()), job.id)

    row = Job.objects.get(pk=job.id)
    assert (row.state, row.last_error) == ("failed", "handler_error")
    assert "must be called inside transaction.atomic" in row.error_detail


def test_a_stale_handler_gets_lease_lost_and_its_business_write_rolls_back():
    JobFactory()
    job = claim()
    stale = context(job)
    fresh = next_attempt(job)  # its lease was lost and another attempt holds the row

    with pytest.raises(LeaseLost, match="no longer holds the job"), transaction.atomic():
        TenantOverride.objects.create(tenant=business(stale), component="x")
        jobs.complete(stale, "stale")

    assert not TenantOverride.objects.filter(tenant=business(stale)).exists()
    row = Job.objects.get(pk=job.id)
    assert (row.state, row.claim_token, row.result) == ("running", fresh.claim_token, None)


def test_a_stale_handler_in_a_real_worker_cannot_commit_its_business_write():
    seen = Seen()
    job = enqueue(Finish(action="stale"))
    registry = Registry([JobType(Finish, finish(seen), Policy(max_attempts=1))])
    worker = Worker(registry, WorkerConfig(poll_interval=0.05, install_signal_handlers=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert seen.started.wait(10)
        taken = uuid.uuid4()  # another worker claimed the job after this one's lease lapsed
        Job.objects.filter(pk=job.id).update(claim_token=taken)
        seen.go.set()
        wait_for(lambda: seen.errors and worker.idle, what="the handler finished", interval=0.01)
    finally:
        worker.request_stop()
        thread.join(10)
    assert [type(error) for error in seen.errors] == [LeaseLost]
    assert not TenantOverride.objects.filter(tenant=f"paid-{job.id}").exists()
    row = Job.objects.get(pk=job.id)
    assert (row.state, row.claim_token, row.result) == ("running", taken, None)


def test_a_completion_waiting_on_the_row_while_it_is_reclaimed_gets_lease_lost():
    """The re-check after the wait: the token is read from the row as committed."""
    JobFactory()
    job = claim()
    stale = context(job)
    locked, blocked = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def reclaim() -> None:  # another session: holds the row, then moves the token on
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=job.id)
                locked.set()
                wait_for(waiting_on_a_lock, what="the completion waits for the row", interval=0.01)
                blocked.set()
                Job.objects.filter(pk=job.id).update(claim_token=uuid.uuid4())
        finally:
            connection.close()

    thread = threading.Thread(target=reclaim)
    thread.start()
    try:
        assert locked.wait(10)
        try:
            with transaction.atomic():
                TenantOverride.objects.create(tenant=business(stale), component="x")
                jobs.complete(stale)
        except LeaseLost as exc:
            outcome["raised"] = exc
    finally:
        thread.join(10)
    assert blocked.is_set() and isinstance(outcome.get("raised"), LeaseLost)
    assert not TenantOverride.objects.filter(tenant=business(stale)).exists()
    assert Job.objects.get(pk=job.id).state == "running"
