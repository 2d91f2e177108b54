"""The worker in-process against real PostgreSQL: every row of the outcome table and more."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import JobContext, Payload, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.queue import NewJob
from jobs.scheduler import metrics as scheduler_metrics
from jobs.scheduler.gauges import Gauges
from jobs.testing import JobFailed, WorkerTimeout, run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.leases import LeaseKeeper
from jobs.worker.maintenance import WorkerMaintenance
from jobs.worker.runner import Worker
from tests.support.factories import JobFactory, TenantOverrideFactory
from tests.support.polling import wait_for
from tests.support.worker import Echo, Recorder, Step, registry, scripted

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def recorder():
    return Recorder()


def hold_row_lock(pk: int, locked: threading.Event, release: threading.Event) -> None:
    """Hold job ``pk``'s row locked in a transaction of this thread until ``release``."""
    with transaction.atomic():
        Job.objects.select_for_update().get(pk=pk)
        locked.set()
        release.wait(30)
    connection.close()


def row(enqueued) -> Job:
    return Job.objects.get(pk=enqueued.id)


class TestOutcomeTable:
    def test_handler_returns_completes_with_result_and_context(self, recorder):
        done = enqueue(Echo(text="hello"), job_id="e-1", tenant="acme")

        run_worker(registry=registry(recorder))

        job = row(done)
        assert (job.state, job.attempts, job.result, job.last_error) == (
            "succeeded",
            1,
            "hello",
            "",
        )
        [(payload, ctx)] = recorder.calls
        assert payload == Echo(text="hello")
        assert (ctx.job_id, ctx.tenant, ctx.attempt, ctx.final_attempt) == ("e-1", "acme", 1, False)

    @pytest.mark.parametrize(
        "stored",
        [{"text": "invalid"}, {"text": "x", "extra": 1}, {}, {"text": 5}],
        ids=["validate-fails", "unknown-field", "missing-field", "wrong-type"],
    )
    def test_invalid_payload_fails_without_calling_the_handler(self, recorder, stored):
        bad = queue.enqueue(NewJob(Echo.job_name, stored))

        with pytest.raises(JobFailed) as failed:
            run_worker(registry=registry(recorder))

        assert failed.value.code == "invalid_payload"
        assert (row(bad).state, row(bad).last_error, row(bad).attempts) == (
            "failed",
            "invalid_payload",
            1,
        )
        assert recorder.calls == []

    @pytest.mark.parametrize("action", ["reject", "permanent"])
    def test_rejected_and_permanent_errors_fail_at_once(self, recorder, action):
        job = enqueue(Step(plan=(action, "ok")))

        with pytest.raises(JobFailed, match="rejected"):
            run_worker(registry=registry(recorder))

        assert (row(job).state, row(job).attempts, row(job).last_error) == ("failed", 1, "rejected")
        assert len(recorder.calls) == 1

    def test_handler_error_retries_then_succeeds_on_the_same_row(self, recorder):
        job = enqueue(Step(plan=("error", "error", "ok")))

        run_worker(registry=registry(recorder))

        assert (row(job).state, row(job).attempts, row(job).last_error) == ("succeeded", 3, "")
        assert [ctx.attempt for _, ctx in recorder.calls] == [1, 2, 3]
        assert Job.objects.count() == 1

    def test_handler_error_on_the_last_attempt_fails(self, recorder):
        job = enqueue(Step(plan=("error",)))

        with pytest.raises(JobFailed, match="handler_error"):
            run_worker(registry=registry(recorder))

        assert (row(job).state, row(job).attempts) == ("failed", 3)
        assert "ConnectionError: upstream unavailable" in row(job).error_detail
        assert recorder.calls[-1][1].final_attempt

    def test_overrunning_the_timeout_is_deadline_exceeded(self, recorder):
        job = enqueue(Step(plan=("slow", "ok"), seconds=5))

        run_worker(registry=registry(recorder, timeout=timedelta(milliseconds=200)))

        assert (row(job).state, row(job).attempts) == ("succeeded", 2)
        first_ctx = recorder.calls[0][1]
        assert first_ctx.cancelled.is_set(), "the overrunning handler was told to stop"

    def test_deadline_exceeded_on_the_last_attempt_fails(self, recorder):
        job = enqueue(Step(plan=("slow",), seconds=5))
        with pytest.raises(JobFailed, match="deadline_exceeded"):
            run_worker(registry=registry(recorder, timeout=0.1, max_attempts=1))
        assert row(job).last_error == "deadline_exceeded"

    def test_lease_expired_on_the_last_attempt_fails_by_the_exhaustion_pass(self, recorder):
        dead = JobFactory(
            name=Step.job_name,
            running=True,
            attempts=3,
            max_attempts=3,
            lease_expires_at=timezone.now() - timedelta(seconds=1),
        )
        with pytest.raises(JobFailed, match="lease_expired"):
            run_worker(registry=registry(recorder))
        assert Job.objects.get(pk=dead.pk).last_error == "lease_expired"

    def test_lowered_attempt_limit_fails_as_attempts_exhausted(self, recorder):
        JobFactory(name=Step.job_name, attempts=3, max_attempts=10)
        with pytest.raises(JobFailed, match="attempts_exhausted"):
            run_worker(registry=registry(recorder, max_attempts=3))
        assert recorder.calls == []


class TestRetryAfter:
    def test_short_retry_after_is_waited_out_in_process(self, recorder):
        job = enqueue(Step(plan=("retry-after", "ok"), seconds=0.05))

        run_worker(registry=registry(recorder))

        first, second = (ctx for _, ctx in recorder.calls)
        assert first is second, "same claim, same context: the queue was not involved"
        assert (row(job).state, row(job).attempts) == ("succeeded", 2)

    def test_long_retry_after_goes_back_to_the_queue_and_frees_the_slot(self, recorder):
        job = enqueue(Step(plan=("retry-after", "ok"), seconds=3600))

        run_worker(registry=registry(recorder))

        queued = row(job)
        assert (queued.state, queued.attempts, queued.last_error) == ("queued", 1, "handler_error")
        wait = (queued.run_after - timezone.now()).total_seconds()
        assert 3500 < wait <= 3600


def test_type_concurrency_is_never_exceeded_and_is_said_at_start(recorder, caplog):
    for _ in range(12):
        enqueue(Step(plan=("sleep",), seconds=0.05))

    with caplog.at_level(logging.INFO, logger="jobs.worker"):
        run_worker(registry=registry(recorder, concurrency=2), concurrency=8)

    assert recorder.peak[Step.job_name] == 2
    assert Job.objects.filter(state="succeeded").count() == 12
    [started] = [r.getMessage() for r in caplog.records if " started: " in r.getMessage()]
    assert f"{Step.job_name} (at most 2 at once)" in started


def test_a_type_without_a_concurrency_of_its_own_uses_every_slot_of_the_worker(recorder):
    """``@job(Payload)`` plus ``runworker --concurrency 4`` runs four of that type at once."""
    together = threading.Barrier(4)

    def meet(payload: Echo, ctx):
        recorder.enter(payload, ctx)
        try:
            together.wait(timeout=5)  # broken (and the job failed) unless all four run at once
        finally:
            recorder.leave(ctx)

    for n in range(4):
        enqueue(Echo(text=f"t{n}"))

    run_worker(registry=Registry([JobType(Echo, meet, Policy())]), concurrency=4)

    assert recorder.peak[Echo.job_name] == 4
    assert Job.objects.filter(state="succeeded").count() == 4


def test_a_type_with_nothing_due_leaves_its_share_of_the_slots_to_the_others(recorder):
    """Slots are shared among the types, and a share nobody uses goes round again at once."""
    together = threading.Barrier(4)

    def meet(payload: Echo, ctx):
        together.wait(timeout=5)  # broken (and the job failed) unless all four run at once

    for n in range(4):
        enqueue(Echo(text=f"t{n}"))
    idle = JobType(Step, scripted(recorder), Policy())  # registered, nothing enqueued

    run_worker(registry=Registry([JobType(Echo, meet, Policy()), idle]), concurrency=4)

    assert Job.objects.filter(state="succeeded").count() == 4


def test_unsupported_names_stay_queued_and_are_reported(recorder, caplog):
    """Workers leave them alone; the scheduler's leader counts them once per deployment."""
    stranger = queue.enqueue(NewJob("nobody.handles.v1", {"x": 1}))
    scheduler_metrics.backlog.clear()

    with caplog.at_level(logging.WARNING):
        run_worker(registry=registry(recorder))
        assert (row(stranger).state, row(stranger).attempts) == ("queued", 0)
        assert "unsupported" not in caplog.text  # workers no longer count the backlog
        Gauges(registry(recorder).names()).run_once()

    assert "unsupported job types remain outstanding: nobody.handles.v1 (1)" in caplog.text
    [record] = [r for r in caplog.records if "unsupported" in r.getMessage()]
    assert record.name == "jobs.scheduler"
    assert scheduler_metrics.backlog.labels("nobody.handles.v1", "false")._value.get() == 1


def test_the_maintenance_pass_runs_only_the_exhaustion_statement(recorder):
    """The backlog count moved to the scheduler's leader: a worker's 15 s pass is one bounded
    statement, whatever the backlog holds."""
    JobFactory.create_batch(3, name=Echo.job_name)
    maintenance = WorkerMaintenance(WorkerConfig(), registry(recorder))

    with CaptureQueriesContext(connection) as ctx:
        maintenance.run_once()

    assert len(ctx.captured_queries) == 1, [q["sql"] for q in ctx.captured_queries]
    assert "UPDATE jobs_job" in ctx.captured_queries[0]["sql"]


class TestScopes:
    def test_base_worker_skips_overridden_tenants(self, recorder):
        TenantOverrideFactory(tenant="branchy", component="worker")
        skipped = enqueue(Echo(text="a"), tenant="branchy")
        served = enqueue(Echo(text="b"), tenant="main")

        run_worker(registry=registry(recorder))

        assert row(served).state == "succeeded"
        assert row(skipped).state == "queued"

    def test_branch_worker_serves_only_its_tenant(self, recorder):
        TenantOverrideFactory(tenant="branchy", component="worker")
        mine = enqueue(Echo(text="a"), tenant="branchy")
        other = enqueue(Echo(text="b"), tenant="main")

        run_worker(registry=registry(recorder), tenant="branchy")

        assert row(mine).state == "succeeded"
        assert row(other).state == "queued"


class TestTestHelper:
    def test_raises_at_once_on_a_terminal_failure(self, recorder):
        enqueue(Step(plan=("reject",)))
        slow = enqueue(
            Step(plan=("sleep",), seconds=0.01), job_id="later", delay=timedelta(seconds=5)
        )
        started = time.monotonic()
        with pytest.raises(JobFailed):
            run_worker(registry=registry(recorder), timeout=10)
        assert time.monotonic() - started < 3
        assert row(slow).state == "queued"

    def test_times_out_listing_what_is_left(self, recorder):
        enqueue(Step(plan=("sleep",), seconds=0.01), delay=timedelta(seconds=0.5))
        enqueue(Step(plan=("slow",), seconds=3))
        with pytest.raises(WorkerTimeout, match=r"test\.step\.v1"):
            run_worker(registry=registry(recorder), timeout=0.3)

    def test_refuses_to_run_inside_a_transaction(self, recorder):
        from django.db import transaction

        with (
            pytest.raises(RuntimeError, match="cannot run inside a transaction"),
            transaction.atomic(),
        ):
            run_worker(registry=registry(recorder))


class TestLeasesAndDrain:
    def test_leases_are_renewed_every_third_of_their_length(self):
        class Recording(LeaseKeeper):
            def renew_once(self, now=None):
                renewals.append(time.monotonic())
                return set()

        renewals: list[float] = []
        keeper = Recording(list, lease_seconds=0.6, tick=0.01)
        keeper.start()
        try:
            wait_for(lambda: len(renewals) >= 5, timeout=5, interval=0.01)
        finally:
            keeper.stop()
        gaps = [b - a for a, b in itertools.pairwise(renewals)]
        # Every 0.2 s, never sooner; a late tick on a busy machine may stretch one gap a little.
        assert min(gaps) >= 0.19, gaps
        assert sum(gaps) / len(gaps) <= 0.3, gaps

    def test_lost_lease_cancels_the_handler_and_writes_nothing(self, recorder):
        job = enqueue(Step(plan=("slow",), seconds=10))
        config = WorkerConfig(lease=timedelta(seconds=0.3), install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(lambda: recorder.calls, interval=0.01)
            # Another party takes the job: its token changes under the worker.
            Job.objects.filter(pk=job.id).update(claim_token="00000000-0000-0000-0000-000000000001")
            ctx = recorder.calls[0][1]
            wait_for(ctx.cancelled.is_set, timeout=5, interval=0.01)
        finally:
            worker.request_stop()
            thread.join(10)
        stolen = row(job)
        assert (stolen.state, stolen.attempts) == ("running", 1)
        assert str(stolen.claim_token) == "00000000-0000-0000-0000-000000000001"

    def test_drain_hands_back_a_job_that_outlives_the_shutdown_timeout(self, recorder):
        long = enqueue(Step(plan=("slow",), seconds=30))
        short = enqueue(Step(plan=("sleep",), seconds=0.3))
        config = WorkerConfig(shutdown_timeout=1.0, install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        wait_for(lambda: len(recorder.calls) == 2, interval=0.01)
        worker.request_stop()
        thread.join(10)
        assert not thread.is_alive()
        assert row(short).state == "succeeded"
        handed_back = row(long)
        assert (handed_back.state, handed_back.attempts, handed_back.claim_token) == (
            "queued",
            0,
            None,
        )

    def test_a_retry_due_soon_runs_when_due_not_at_the_next_poll(self, recorder):
        # The retry is written in the same statement as the next claim, which cannot see it,
        # and no NOTIFY announces a retry: the worker must wake for it by itself.
        job = enqueue(Step(plan=("error", "ok")))
        config = WorkerConfig(poll_interval=60, install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(lambda: row(job).state == "succeeded", timeout=5, interval=0.01)
        finally:
            worker.request_stop()
            thread.join(10)
        assert row(job).attempts == 2

    def test_an_outcome_whose_row_stays_locked_waits_and_warns_once(self, recorder, caplog):
        # A moment's lock (the worker's own lease renewal, usually) is no news: DEBUG. Held
        # for three tries in a row it is: one WARNING. The outcome is written once it is free.
        caplog.set_level(logging.DEBUG, logger="jobs.worker")
        job = enqueue(Step(plan=("sleep",), seconds=0.3))
        worker = Worker(
            registry(recorder), WorkerConfig(poll_interval=0.05, install_signal_handlers=False)
        )
        thread = threading.Thread(target=worker.run)
        thread.start()
        locked, release = threading.Event(), threading.Event()

        def waits(level: int) -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.levelno == level and "holds its row locked" in r.getMessage()
            ]

        try:
            wait_for(lambda: len(recorder.calls) == 1, interval=0.01)  # the handler is in its sleep
            holder = threading.Thread(target=hold_row_lock, args=(job.id, locked, release))
            holder.start()
            assert locked.wait(10)
            wait_for(lambda: waits(logging.WARNING), interval=0.01)
            assert row(job).state == "running"
            release.set()
            holder.join(10)
            wait_for(lambda: row(job).state == "succeeded", interval=0.01)
        finally:
            release.set()
            worker.request_stop()
            thread.join(10)
        assert waits(logging.WARNING) == [
            f"outcome of job {job.job_id} (test.step.v1) waits (try 3): another session holds "
            "its row locked"
        ]
        assert len(waits(logging.DEBUG)) >= 2  # tries 1 and 2, and any after the third

    def test_an_outcome_whose_row_was_locked_for_a_moment_is_written_soon_after(self, recorder):
        # Another worker's claim locks a row it read as queued and found claimed meanwhile,
        # until its statement ends; the outcome then waits for a retry. Retried a poll
        # interval later, the last jobs of a two-worker drain stayed running for half a second.
        job = enqueue(Step(plan=("sleep",), seconds=0.3))
        worker = Worker(
            registry(recorder), WorkerConfig(poll_interval=5, install_signal_handlers=False)
        )
        thread = threading.Thread(target=worker.run)
        thread.start()
        locked, release = threading.Event(), threading.Event()
        tried = threading.Event()
        original = worker.completer.defer_busy

        def noting(*args, **kwargs):
            tried.set()
            return original(*args, **kwargs)

        worker.completer.defer_busy = noting
        holder = threading.Thread(target=hold_row_lock, args=(job.id, locked, release))
        try:
            wait_for(lambda: len(recorder.calls) == 1, interval=0.01)  # the handler is in its sleep
            holder.start()
            assert locked.wait(10)
            assert tried.wait(10), "the outcome never met the lock"
            release.set()
            holder.join(10)
            released = time.monotonic()
            wait_for(lambda: row(job).state == "succeeded", timeout=10, interval=0.01)
            took = time.monotonic() - released
        finally:
            release.set()
            worker.request_stop()
            thread.join(10)
        assert took < 1.0, f"written {took:.1f}s after the lock went (poll interval 5s)"

    def test_a_notice_that_comes_during_an_empty_claim_is_not_lost(self, recorder, monkeypatch):
        # The claim's snapshot can predate a commit whose NOTIFY the listener handles before
        # the claim returns empty: the type must not be marked exhausted until the next poll
        # (60 s here), or the job waits for it.
        config = WorkerConfig(poll_interval=60, install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        real = queue.record_and_claim
        armed = threading.Event()
        raced: list[Job] = []

        def claim_then_commit(outcomes, requests, **kwargs):
            report, claimed = real(outcomes, requests, **kwargs)
            if armed.is_set() and not claimed:
                armed.clear()
                worker._wake.clear()
                # Another session commits a job now, after this claim's snapshot.
                producer = threading.Thread(target=lambda: raced.append(enqueue(Echo(text="x"))))
                producer.start()
                producer.join(10)
                wait_for(
                    worker._wake.is_set, timeout=5, interval=0.01
                )  # its NOTIFY reached the listener
            return report, claimed

        monkeypatch.setattr(queue, "record_and_claim", claim_then_commit)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(lambda: worker.listening, interval=0.01)
            wait_for(lambda: worker.idle, interval=0.01)
            armed.set()
            worker._work_arrived("test.echo.v1")  # a pass whose claim finds nothing
            wait_for(lambda: not armed.is_set(), timeout=5, interval=0.01)
            wait_for(lambda: len(recorder.calls) == 1, timeout=5, interval=0.01)
        finally:
            worker.request_stop()
            thread.join(10)
        assert row(raced[0]).state == "succeeded"

    def test_notify_wakes_an_idle_worker_at_once(self, recorder):
        config = WorkerConfig(poll_interval=60, install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(lambda: worker.listening, interval=0.01)
            enqueue(Echo(text="first"))
            wait_for(lambda: len(recorder.calls) == 1 and worker.idle, interval=0.01)
            # The worker now waits for its 60 s poll: only a NOTIFY can wake it sooner.
            started = time.monotonic()
            enqueue(Echo(text="second"))
            wait_for(lambda: len(recorder.calls) == 2, timeout=5, interval=0.01)
            assert time.monotonic() - started < 2
        finally:
            worker.request_stop()
            thread.join(10)


class SlowV1(Payload, name="test.share.slow.v1"):
    n: int = 0


class QuickV1(Payload, name="test.share.quick.v1"):
    n: int = 0


@pytest.mark.django_db(transaction=True)
def test_types_without_a_limit_share_the_free_slots_of_one_claim():
    """Two unlimited types with work due, four slots: both run, neither waits for the other."""
    release = threading.Event()
    seen: list[str] = []
    lock = threading.Lock()

    def handler(payload, ctx: JobContext) -> None:
        with lock:
            seen.append(ctx.name)
        release.wait(10)

    for n in range(6):
        queue.enqueue_many([NewJob(SlowV1.job_name, {"n": n}), NewJob(QuickV1.job_name, {"n": n})])
    registry = Registry([JobType(SlowV1, handler, Policy()), JobType(QuickV1, handler, Policy())])
    first_four: list[str] = []

    def watch() -> None:
        try:
            wait_for(lambda: len(seen) >= 4, what="four jobs to start", interval=0.01)
            with lock:
                first_four.extend(seen[:4])
        finally:
            release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_worker(registry=registry, concurrency=4, timeout=30)
    finally:
        release.set()
        watcher.join(15)

    assert Job.objects.filter(state="succeeded").count() == 12
    # Not all four first slots to whichever name the rotation put first.
    assert set(Counter(first_four)) == {SlowV1.job_name, QuickV1.job_name}, first_four
