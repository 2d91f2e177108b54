"""Pause and resume, cancel of running jobs, and the attempt log, through the queue and an
in-process worker on real PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from jobs import JobContext, Payload, Policy, RetryAfter, enqueue, queue
from jobs.catalogue.registry import Backoff, JobType, Registry
from jobs.control import cancels
from jobs.core.conf import NOTIFY_CHANNEL
from jobs.models import Job, Pause, TenantOverride
from jobs.queue import (
    AllTenants,
    AllTenantsExcept,
    ClaimRequest,
    NewJob,
    OnlyTenant,
    Outcome,
    attempts,
    flow,
)
from jobs.queue.flow import FlowLimits
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.runapp.models import Delivery
from tests.support.admin import operator
from tests.support.factories import JobFactory
from tests.support.polling import wait_for
from tests.support.worker import Recorder, Step, registry


def outcomes_counted(job_type: str, kind: str) -> float:
    labels = {"job_type": job_type, "outcome": kind}
    return REGISTRY.get_sample_value("jobs_outcomes_total", labels) or 0.0


NOOP = "test.noop.v1"
OTHER = "test.other.v1"


def claim(names=(NOOP,), limit=100, scope=None, worker="w1", caps=None):
    requests = [ClaimRequest(n, limit, (caps or {}).get(n)) for n in names]
    return queue.claim(requests, scope=scope or AllTenants(), worker=worker)


@pytest.mark.django_db
class TestPause:
    def test_a_paused_job_type_is_not_claimed_and_its_backlog_stays_queued(self):
        queue.enqueue_many([NewJob(NOOP), NewJob(NOOP), NewJob("test.other.v1")])
        assert queue.pause("job_type", NOOP, by="alice", reason="incident 42") is True

        claimed = claim((NOOP, "test.other.v1"))

        assert [j.name for j in claimed] == ["test.other.v1"]
        assert Job.objects.filter(name=NOOP, state="queued").count() == 2
        queue.enqueue(NewJob(NOOP))  # the backlog keeps growing while paused
        assert Job.objects.filter(name=NOOP, state="queued").count() == 3
        assert queue.resume("job_type", NOOP) is True
        assert len(claim()) == 3

    @pytest.mark.parametrize("kind,field", [("queue", "queue"), ("tenant", "tenant")])
    def test_a_paused_queue_or_tenant_is_skipped_within_a_job_type(self, kind, field, claim_form):
        for value in ("a", "b", "a", "b"):
            queue.enqueue(NewJob(NOOP, **{field: value}))
        queue.pause(kind, "a", by="alice")

        claimed = claim()

        assert sorted(getattr(j, field) for j in claimed) == ["b", "b"]
        queue.resume(kind, "a")
        assert sorted(getattr(j, field) for j in claim()) == ["a", "a"]

    def test_pause_twice_and_resume_twice_change_nothing_the_second_time(self):
        assert queue.pause("queue", "emails", by="alice") is True
        assert queue.pause("queue", "emails", by="bob", reason="again") is False
        row = Pause.objects.get()
        assert (row.kind, row.value, row.paused_by) == ("queue", "emails", "alice")
        assert [p.value for p in queue.paused()] == ["emails"]
        assert queue.resume("queue", "emails") is True
        assert queue.resume("queue", "emails") is False
        assert not Pause.objects.exists()

    @pytest.mark.parametrize(
        "kind,value,message",
        [
            ("host", "x", "cannot pause a 'host'"),
            ("queue", "", "name the queue"),
            ("queue", "   ", "name the queue"),
            ("tenant", "x" * 65, "1-64 characters"),
            ("queue", "emails ", "1-64 characters"),
            ("job_type", "x" * 201, "at most 200"),
            ("job_type", "shop.send.v1 ", "does not start or end with a space"),
            ("job_type", "a\x00b", "job_type name"),
        ],
    )
    def test_bad_input_is_refused_with_a_clear_message(self, kind, value, message):
        with pytest.raises(ValueError, match=message):
            queue.pause(kind, value, by="alice")
        assert not Pause.objects.exists()

    def test_running_jobs_of_a_paused_type_still_report_their_outcome(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.pause("job_type", NOOP, by="alice")
        assert queue.complete(job) is True
        assert Job.objects.get(pk=job.id).state == "succeeded"

    @settings(
        max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        jobs=st.lists(
            st.tuples(st.sampled_from("ab"), st.sampled_from("xy"), st.sampled_from("mn")),
            min_size=1,
            max_size=12,
        ),
        paused=st.sets(
            st.sampled_from(
                [("job_type", "t.a"), ("job_type", "t.b"), ("queue", "x"), ("tenant", "m")]
            ),
        ),
    )
    def test_a_claim_takes_exactly_the_due_jobs_no_pause_covers(self, jobs, paused):
        Job.objects.all().delete()
        Pause.objects.all().delete()
        for name, queue_, tenant in jobs:
            queue.enqueue(NewJob(f"t.{name}", queue=queue_, tenant=tenant))
        for kind, value in paused:
            queue.pause(kind, value, by="prop")

        claimed = claim(("t.a", "t.b"))

        def allowed(name, queue_, tenant):
            return not (
                ("job_type", f"t.{name}") in paused
                or ("queue", queue_) in paused
                or ("tenant", tenant) in paused
            )

        expected = sorted((f"t.{n}", q, t) for n, q, t in jobs if allowed(n, q, t))
        assert sorted((j.name, j.queue, j.tenant) for j in claimed) == expected


@pytest.mark.django_db
class TestCancelRunning:
    def test_a_running_job_is_asked_once_and_its_renewal_reports_it(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()

        assert queue.cancel_running([job.id], by="alice") == [job.id]
        assert queue.cancel_running([job.id], by="bob") == []  # asked already

        row = Job.objects.get(pk=job.id)
        assert (row.state, row.cancel_requested_by) == ("running", "alice")
        renewal = queue.renew_leases([job])
        assert renewal.cancel_requested == {job.claim_token} and not renewal.lost

    def test_queued_and_finished_jobs_are_not_asked(self):
        queued = JobFactory()
        done = JobFactory(succeeded=True)
        assert queue.cancel_running([queued.pk, done.pk], by="alice") == []

    @pytest.mark.parametrize("outcome", ["retry", "released", "cancelled"])
    def test_an_asked_attempt_that_would_go_back_to_the_queue_ends_cancelled(self, outcome):
        queue.enqueue(NewJob(NOOP, job_id="k1"))
        [job] = claim()
        queue.cancel_running([job.id], by="alice")

        made = {
            "retry": lambda: Outcome.retry(job, code="handler_error"),
            "released": lambda: Outcome.released(job),
            "cancelled": lambda: Outcome.cancelled(job),
        }[outcome]()
        assert queue.record([made]).applied == (job.id,)

        row = Job.objects.get(pk=job.id)
        assert (row.state, row.last_error) == ("cancelled", "cancelled")
        assert row.error_detail == "cancelled while running, asked by alice"
        assert row.key_held is True  # kept through FAILURE_WINDOW, as after a failure
        assert row.finished_at is not None and row.claim_token is None

    def test_an_attempt_that_finished_before_its_worker_learned_keeps_its_outcome(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.cancel_running([job.id], by="alice")
        assert queue.complete(job, {"done": True}) is True
        assert Job.objects.get(pk=job.id).state == "succeeded"

    def test_a_stale_workers_cancelled_outcome_is_fenced(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.cancel_running([job.id], by="alice")
        Job.objects.filter(pk=job.id).update(
            lease_expires_at=Job.objects.get(pk=job.id).started_at - timedelta(seconds=1)
        )
        [swept] = queue.requeue_expired()
        assert swept.state == "cancelled"  # asked to stop: not retried after the lease expired
        report = queue.record([Outcome.cancelled(job)])
        assert report.fenced == (job.id,)
        row = Job.objects.get(pk=job.id)
        assert row.last_error == "cancelled"
        assert row.error_detail.startswith("cancelled by alice; the lease expired")
        [attempt] = attempts.of(row)
        assert (attempt.outcome, attempt.code) == ("cancelled", "cancelled")

    def test_replay_of_a_cancelled_job_clears_the_request(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.cancel_running([job.id], by="alice")
        queue.record([Outcome.cancelled(job)])
        assert queue.replay([job.id], by="bob").replayed == (job.id,)
        row = Job.objects.get(pk=job.id)
        assert (row.state, row.cancel_requested_at, row.cancel_requested_by) == ("queued", None, "")
        [again] = claim()
        assert not queue.renew_leases([again]).cancel_requested


def attempts_of(job_id: int) -> list[attempts.Attempt]:
    return attempts.of(Job.objects.get(pk=job_id))


def expire(job_id: int) -> None:
    row = Job.objects.get(pk=job_id)
    Job.objects.filter(pk=job_id).update(lease_expires_at=row.started_at - timedelta(seconds=1))


@pytest.mark.django_db
class TestAttemptLog:
    def test_each_attempt_is_kept_with_start_end_worker_outcome_and_error(self):
        queue.enqueue(NewJob(NOOP, max_attempts=3))
        [first] = claim()
        queue.retry(first, code="handler_error", detail="boom\n" * 10, delay=0)
        [second] = claim()
        queue.complete(second, {"ok": 1})

        log = attempts_of(first.id)

        assert [(a.attempt, a.outcome, a.code, a.worker) for a in log] == [
            (1, "retry", "handler_error", "w1"),
            (2, "succeeded", "", "w1"),
        ]
        assert log[0].error == ("boom\n" * 10)
        assert log[1].error == ""
        assert log[0].ended_at <= log[1].started_at
        assert all(a.duration is not None and a.duration >= 0 for a in log)

    def test_a_job_run_once_writes_nothing_to_the_log(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        assert [a.outcome for a in attempts_of(job.id)] == ["running"]
        queue.complete(job)
        row = Job.objects.get(pk=job.id)
        assert row.attempt_log == []  # the columns describe the one attempt
        [only] = attempts.of(row)
        assert (only.attempt, only.outcome, only.worker) == (1, "succeeded", "w1")
        assert (only.started_at, only.ended_at) == (row.started_at, row.finished_at)

    def test_a_logged_error_keeps_its_end(self):
        queue.enqueue(NewJob(NOOP, max_attempts=2))
        [job] = claim()
        queue.retry(job, code="handler_error", detail="x" * 5000 + "the last line")
        [entry] = attempts.read(Job.objects.get(pk=job.id).attempt_log)
        assert len(entry.error) == attempts.ERROR_MAX
        assert entry.error.endswith("the last line")

    def test_a_hand_back_is_not_an_attempt(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.release([job])
        row = Job.objects.get(pk=job.id)
        assert (row.attempts, row.attempt_log, attempts.of(row)) == (0, [], [])

    def test_an_in_process_retry_logs_the_attempt_it_ends(self):
        queue.enqueue(NewJob(NOOP, max_attempts=3))
        [job] = claim()
        assert queue.next_attempt(job, code="handler_error", detail="slow down") == 2
        queue.complete(job)
        assert [(a.attempt, a.outcome, a.error) for a in attempts_of(job.id)] == [
            (1, "retry", "slow down"),
            (2, "succeeded", ""),
        ]

    def test_an_expired_lease_is_an_attempt_and_so_is_the_last_one_it_fails(self):
        queue.enqueue(NewJob(NOOP, max_attempts=2))
        [job] = claim()
        expire(job.id)
        queue.requeue_expired()
        [again] = claim()
        expire(again.id)
        queue.fail_exhausted()
        log = attempts_of(job.id)
        assert [(a.attempt, a.outcome, a.code, a.worker) for a in log] == [
            (1, "lease_expired", "lease_expired", "w1"),
            (2, "failed", "lease_expired", "w1"),
        ]

    def test_lowered_attempts_fail_a_queued_job_without_a_made_up_attempt(self):
        queue.enqueue(NewJob(NOOP, max_attempts=3))
        [job] = claim()
        queue.retry(job, code="handler_error", detail="boom")
        queue.fail_exhausted(max_attempts={NOOP: 1})
        assert Job.objects.get(pk=job.id).state == "failed"
        assert [a.outcome for a in attempts_of(job.id)] == ["retry"]

    def test_a_replay_keeps_the_earlier_run_and_the_log_survives_the_history(self):
        queue.enqueue(NewJob(NOOP))
        [job] = claim()
        queue.fail(job, code="handler_error", detail="boom")
        Job.objects.filter(pk=job.id).update(
            key_held=False, finished_at=Job.objects.get(pk=job.id).finished_at - timedelta(days=1)
        )
        queue.history.archive()
        from jobs.models import JobHistory

        moved = JobHistory.objects.get(pk=job.id)
        assert [a.outcome for a in attempts.of(moved)] == ["failed"]
        queue.replay([job.id], by="alice")
        assert [(a.outcome, a.error) for a in attempts_of(job.id)] == [("failed", "boom")]
        [again] = claim()
        queue.complete(again)
        assert [(a.attempt, a.outcome) for a in attempts_of(job.id)] == [
            (1, "failed"),
            (1, "succeeded"),
        ]

    def test_malformed_entries_are_skipped_when_read(self):
        assert attempts.read(None) == []
        log = [1, "x", {"attempt": "nope"}, {"attempt": 2, "outcome": "failed"}]
        assert [(a.attempt, a.outcome) for a in attempts.read(log)] == [(2, "failed")]

    @settings(
        max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(
        steps=st.lists(
            st.sampled_from(["retry", "in_process", "expire", "release", "end", "replay"]),
            min_size=1,
            max_size=12,
        ),
        ending=st.sampled_from(["complete", "fail", "cancelled"]),
    )
    def test_every_attempt_run_is_listed_once_in_order(self, steps, ending):
        """Whatever happens to a job, attempts.of lists each attempt that ran, in order."""
        Job.objects.all().delete()
        created = queue.enqueue(NewJob(NOOP, max_attempts=50))
        ran = 0  # attempts that ran, across replays
        for step in steps:
            row = Job.objects.get(pk=created.id)
            if row.state in ("succeeded", "failed", "cancelled"):
                if step == "replay":
                    queue.replay([created.id], by="prop")
                continue
            [job] = claim()
            if step == "release":
                queue.release([job])
                continue
            ran += 1
            if step == "retry":
                queue.retry(job, code="handler_error", detail=f"attempt {ran}")
            elif step == "in_process":
                queue.next_attempt(job, code="handler_error", detail=f"attempt {ran}")
                ran += 1
                queue.retry(job, code="handler_error", detail=f"attempt {ran}")
            elif step == "expire":
                expire(job.id)
                queue.requeue_expired()
            elif ending == "complete":
                queue.complete(job)
            elif ending == "fail":
                queue.fail(job, code="rejected", detail="no")
            else:
                queue.record([Outcome.cancelled(job)])

        listed = attempts_of(created.id)

        assert len(listed) == ran
        assert all(a.outcome != "running" for a in listed)
        ends = [a.ended_at for a in listed]
        assert ends == sorted(ends)
        assert all(a.started_at <= a.ended_at for a in listed)


@pytest.mark.django_db(transaction=True)
class TestWorker:
    def test_cancel_of_a_running_job_stops_its_handler_and_ends_it_cancelled(self):
        recorder = Recorder()
        job = enqueue(Step(plan=("slow",), seconds=30))
        config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(lambda: recorder.calls, what="the handler started", timeout=20)
            asked = time.monotonic()
            assert queue.cancel_running([job.id], by="alice") == [job.id]
            wait_for(
                lambda: Job.objects.get(pk=job.id).state == "cancelled",
                timeout=10,
                what="the job ended cancelled",
            )
            # Learned at the next renewal: a third of the lease, plus a flush.
            assert time.monotonic() - asked < 0.6 + 1.0
            assert recorder.calls[0][1].cancelled.is_set()
        finally:
            worker.request_stop()
            thread.join(10)
        row = Job.objects.get(pk=job.id)
        assert (row.attempts, row.last_error, row.claim_token) == (1, "cancelled", None)
        assert [a.outcome for a in attempts.of(row)] == ["cancelled"]

    def test_a_cancelled_attempt_is_logged_and_counted_as_cancelled_not_as_a_retry(self, caplog):
        """The worker counted a cancelled outcome in ``jobs_outcomes_total`` as ``retried`` and
        logged it as "will retry: cancelled", though the job is over for good."""
        recorder = Recorder()
        job = enqueue(Step(plan=("slow",), seconds=30))
        counted = {kind: outcomes_counted(Step.job_name, kind) for kind in ("retried", "cancelled")}
        config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        caplog.set_level("INFO", logger="jobs.worker")
        thread.start()
        try:
            wait_for(lambda: recorder.calls, what="the handler started", timeout=20)
            queue.cancel_running([job.id], by="alice")
            wait_for(
                lambda: outcomes_counted(Step.job_name, "cancelled") > counted["cancelled"],
                timeout=10,
                what="the cancelled outcome counted",
            )
        finally:
            worker.request_stop()
            thread.join(10)
        assert outcomes_counted(Step.job_name, "retried") == counted["retried"]
        said = [r.getMessage() for r in caplog.records if job.job_id in r.getMessage()]
        assert any("cancelled" in line for line in said), said
        assert not any("will retry" in line for line in said), said

    def test_resume_notifies_the_resumed_types_at_commit(self):
        queue.enqueue(NewJob(NOOP, queue="q1"))
        queue.pause("queue", "q1", by="alice")
        params = connection.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        with psycopg.connect(**params, autocommit=True) as listener:
            listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            queue.resume("queue", "q1")
            got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
        assert got == [NOOP]

    def test_a_paused_type_waits_and_resume_wakes_an_idle_worker_at_once(self):
        recorder = Recorder()
        queue.pause("job_type", Step.job_name, by="alice")
        job = enqueue(Step(plan=("ok",)))
        config = WorkerConfig(poll_interval=60, install_signal_handlers=False)
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            wait_for(
                lambda: worker.listening and worker.idle,
                what="an idle, listening worker",
                timeout=20,
            )
            assert Job.objects.get(pk=job.id).state == "queued"
            resumed = time.monotonic()
            queue.resume("job_type", Step.job_name)
            wait_for(lambda: Job.objects.get(pk=job.id).state == "succeeded", timeout=10)
            assert time.monotonic() - resumed < 2  # not the 60 s poll
        finally:
            worker.request_stop()
            thread.join(10)


def row_of(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


def numbers(job_id: int) -> list[int]:
    return [a.attempt for a in attempts.of(row_of(job_id))]


def db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


def lock_waiters() -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cur.fetchone()[0]


class Thread(threading.Thread):
    """A thread on its own database connection that re-raises its error on ``result()``."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.value = None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 10):
        self.join(timeout)
        assert not self.is_alive(), "a test thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.django_db
def test_a_cancelled_hand_back_lists_each_attempt_once():
    """A drain hands back a running attempt (Outcome.released) before the worker's renewal
    learned of the cancel: the outcome CTE turns it into ``cancelled`` but still applies the
    hand-back's ``attempts - 1``, and the row's columns now describe attempt 2's claim under
    attempt 1's number."""
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [first] = claim()
    queue.retry(first, code="handler_error", detail="boom")
    [second] = claim()  # attempt 2
    queue.cancel_running([second.id], by="alice")
    assert queue.record([Outcome.released(second)]).applied == (second.id,)
    row = row_of(second.id)
    assert row.state == "cancelled"

    listed = numbers(second.id)

    assert len(listed) == len(set(listed)), f"an attempt listed twice: {listed}"


@pytest.mark.django_db
@pytest.mark.parametrize("ending", ["cancel", "exhausted"])
def test_a_job_ended_while_queued_after_a_hand_back_lists_each_attempt_once(ending):
    """attempts.of takes the columns for an unlogged attempt when the log's last entry ended
    before ``started_at``; a hand-back leaves ``started_at`` at a claim that is not an
    attempt. Replay then writes the duplicate into the log for good."""
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [first] = claim()
    queue.retry(first, code="handler_error", detail="boom")
    [second] = claim()
    queue.release([second])  # a draining worker hands attempt 2 back untried
    assert row_of(first.id).attempts == 1
    if ending == "cancel":
        assert queue.cancel([first.id], by="alice") == [first.id]
    else:
        assert [r.id for r in queue.fail_exhausted(max_attempts={NOOP: 1})] == [first.id]

    listed = numbers(first.id)
    queue.replay([first.id], by="bob")
    logged = [a.attempt for a in attempts.read(row_of(first.id).attempt_log)]

    assert listed == [1], f"listed {listed}"
    assert logged == [1], f"logged {logged}"


@pytest.mark.django_db
def test_error_text_with_nul_and_huge_tracebacks_is_logged_bounded_and_readable():
    queue.enqueue(NewJob(NOOP, max_attempts=5))
    [job] = claim()
    assert queue.next_attempt(job, code="handler\x00error", detail="a\x00b" + "x" * 100_000) == 2
    queue.retry(job, code="handler_error", detail="head\x00" + "y" * 50_000 + "tail")
    [again] = claim()
    expire(again.id)
    queue.requeue_expired()

    listed = attempts.of(row_of(job.id))

    assert [(a.attempt, a.outcome) for a in listed] == [
        (1, "retry"),
        (2, "retry"),
        (3, "lease_expired"),
    ]
    assert listed[0].code == "handler\\x00error"
    assert all(len(a.error) <= attempts.ERROR_MAX for a in listed)
    assert listed[1].error.endswith("tail")
    ends = [a.ended_at for a in listed]
    assert ends == sorted(ends)


@pytest.mark.django_db
def test_a_row_from_before_the_log_reads_its_last_attempt_from_the_columns():
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [job] = claim()
    queue.retry(job, code="handler_error", detail="boom")
    [again] = claim()
    queue.fail(again, code="rejected", detail="no")
    Job.objects.filter(pk=job.id).update(attempt_log=[])  # written before the column existed

    [only] = attempts.of(row_of(job.id))

    assert (only.attempt, only.outcome, only.code, only.error) == (2, "failed", "rejected", "no")


@pytest.mark.django_db
def test_a_cancelled_job_whose_worker_died_on_its_last_attempt_ends_cancelled():
    """The commonest cancel of a running job is of one that is stuck because its worker is
    gone; with no attempt left the watchdog's exhaustion pass takes it, not requeue_expired."""
    queue.enqueue(NewJob(NOOP, job_id="stuck", max_attempts=1))
    [job] = claim()
    assert queue.cancel_running([job.id], by="alice") == [job.id]
    expire(job.id)

    queue.requeue_expired()
    queue.fail_exhausted()

    row = row_of(job.id)
    assert (row.state, row.last_error) == ("cancelled", "cancelled")


class WaitSyncV1(Payload, name="operator.wait_sync.v1"):
    run_id: int
    seconds: float = 5.0


class WaitAsyncV1(Payload, name="operator.wait_async.v1"):
    run_id: int
    seconds: float = 5.0


raised = threading.Event()


def wait_sync(payload: WaitSyncV1, ctx: JobContext) -> None:
    raised.set()
    raise RetryAfter(payload.seconds)  # short: waited out in the worker


async def wait_async(payload: WaitAsyncV1, ctx: JobContext) -> None:
    raised.set()
    raise RetryAfter(payload.seconds)


class SleepAsyncV1(Payload, name="operator.sleep_async.v1"):
    run_id: int


class StubbornV1(Payload, name="operator.stubborn.v1"):
    """Retries in process on every attempt; the first attempt waits for the test's go."""


go = threading.Event()


calls: list[int] = []


cancelled_seen: list[str] = []


async def sleep_async(payload: SleepAsyncV1, ctx: JobContext) -> None:
    raised.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancelled_seen.append("CancelledError")
        raise


def stubborn(payload: StubbornV1, ctx: JobContext) -> None:
    calls.append(ctx.attempt)
    if len(calls) == 1:
        raised.set()
        go.wait(10)
    raise RetryAfter(0.05)


def waiting_registry() -> Registry:
    policy = Policy(run_model=Delivery, max_attempts=3, backoff=Backoff(base=0.01, cap=0.05))
    return Registry(
        [
            JobType(WaitSyncV1, wait_sync, policy),
            JobType(WaitAsyncV1, wait_async, policy),
            JobType(SleepAsyncV1, sleep_async, policy),
            JobType(StubbornV1, stubborn, Policy(max_attempts=3)),
        ]
    )


def run_worker_until(done_id: int, predicate, *, lease: float, before=None):
    """Run a worker on waiting_registry() until ``predicate(row)``; stop it; the row."""
    config = WorkerConfig(lease=timedelta(seconds=lease), install_signal_handlers=False)
    worker = Worker(waiting_registry(), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        if before is not None:
            before()
        wait_for(lambda: predicate(row_of(done_id)), timeout=10, what="the job's state")
    finally:
        worker.request_stop(force=True)
        thread.join(10)
    return row_of(done_id)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_cancel_during_an_in_process_retry_wait_ends_the_run_row_cancelled(kind):
    raised.clear()
    row = Delivery.objects.create(job_id=f"wait-{kind}")
    payload = (WaitSyncV1 if kind == "sync" else WaitAsyncV1)(run_id=row.pk)
    done = enqueue(payload)
    config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
    worker = Worker(waiting_registry(), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]
        wait_for(lambda: row_of(done.id).state == "cancelled", timeout=10, what="job cancelled")
    finally:
        worker.request_stop(force=True)
        thread.join(10)
    row.refresh_from_db()
    assert row.state == "cancelled", (
        f"the run row is {row.state} (next_retry_at {row.next_retry_at})"
    )


@pytest.mark.django_db(transaction=True)
def test_in_process_retries_stop_at_a_cancel_and_the_job_ends_cancelled():
    """The cancel commits before the handler's first RetryAfter; the worker has not renewed
    yet (a 30 s lease renews every 10 s). Recording the next attempt is a statement on the
    row, fenced by token, that could see the request, as a claim sees a pause."""
    raised.clear()
    go.clear()
    calls.clear()
    done = enqueue(StubbornV1())

    def cancel_then_go() -> None:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]
        go.set()

    row = run_worker_until(done.id, lambda r: r.state != "running", lease=30, before=cancel_then_go)

    assert (row.state, calls) == ("cancelled", [1]), (
        f"{row.state} / {row.last_error} after attempts {calls}"
    )


@pytest.mark.django_db(transaction=True)
def test_an_async_bound_handler_cancelled_while_awaiting_ends_job_and_row_cancelled():
    raised.clear()
    cancelled_seen.clear()
    run = Delivery.objects.create(job_id="async-sleep")
    done = enqueue(SleepAsyncV1(run_id=run.pk))

    def cancel() -> None:
        assert raised.wait(10), "the handler ran"
        assert queue.cancel_running([done.id], by="alice") == [done.id]

    row = run_worker_until(done.id, lambda r: r.state != "running", lease=0.6, before=cancel)

    assert (row.state, row.last_error, row.attempts) == ("cancelled", "cancelled", 1)
    assert [a.outcome for a in attempts.of(row)] == ["cancelled"]
    assert cancelled_seen == ["CancelledError"]
    run.refresh_from_db()
    assert (run.state, run.last_error) == ("cancelled", "cancelled")
    Delivery.objects.create(job_id="async-sleep")  # the active-state lock is free


@pytest.mark.django_db(transaction=True)
def test_a_cancel_racing_a_retry_is_kept():
    alice = operator("alice", "jobs.cancel_job")
    queue.enqueue(NewJob(NOOP, max_attempts=3))
    [job] = claim()
    holding, go = threading.Event(), threading.Event()

    def worker_writes_a_retry() -> None:
        with transaction.atomic():
            assert queue.retry(job, code="handler_error", delay=3600)
            holding.set()
            go.wait(10)

    writer = Thread(worker_writes_a_retry)
    writer.start()
    assert holding.wait(10)
    canceller = Thread(lambda: cancels.cancel(alice, [job.id], via="test"))
    canceller.start()
    try:
        wait_for(
            lambda: lock_waiters() > 0 or not canceller.is_alive(),
            timeout=10,
            what="the cancel waits for the retry's row lock",
        )
    finally:
        go.set()
        writer.result()
    done = canceller.result()

    row = row_of(job.id)
    assert row.state == "cancelled", f"{row.state}; the cancel reported {done}"


@pytest.mark.django_db
def test_a_stale_workers_outcome_does_not_undo_a_cancel_and_the_key_is_kept():
    queue.enqueue(NewJob(NOOP, job_id="k-stale", max_attempts=3))
    [stale] = claim()
    expire(stale.id)
    queue.requeue_expired()
    [fresh] = claim(worker="w2")
    queue.cancel_running([fresh.id], by="alice")
    # The stale worker's late outcomes, each kind, are fenced; the fresh one ends it cancelled.
    for late in (Outcome.succeeded(stale), Outcome.retry(stale, code="x"), Outcome.released(stale)):
        assert queue.record([late]).fenced == (stale.id,)
    assert queue.record([Outcome.cancelled(fresh)]).applied == (fresh.id,)
    row = row_of(fresh.id)
    assert (row.state, row.key_held, row.claimed_by) == ("cancelled", True, "w2")
    # Kept through FAILURE_WINDOW: the same key is the same job.
    assert queue.enqueue(NewJob(NOOP, job_id="k-stale")).created is False
    assert [(a.attempt, a.outcome, a.worker) for a in attempts.of(row)] == [
        (1, "lease_expired", "w1"),
        (2, "cancelled", "w2"),
    ]


def _grid() -> list[int]:
    """Jobs of two types over two queues, two tenants, two priorities, due and delayed."""
    ids = []
    for name in (NOOP, OTHER):
        for queue_name in ("q1", "q2"):
            for tenant in ("t1", "t2"):
                for priority in (0, 5):
                    for delay in (None, timedelta(hours=1)):
                        ids.append(
                            queue.enqueue(
                                NewJob(
                                    name,
                                    queue=queue_name,
                                    tenant=tenant,
                                    priority=priority,
                                    delay=delay,
                                )
                            ).id
                        )
    return ids


@pytest.mark.django_db
@pytest.mark.parametrize("scope", ["all", "only_t1", "except_t2"])
@pytest.mark.parametrize("via", ["claim", "record_and_claim"])
def test_pauses_only_remove_rows_from_the_claim(claim_form, scope, via):
    """With a queue and a tenant paused, a claim takes exactly what the same claim takes when
    those rows are simply not there: same order, same per-name limits, same caps."""
    _grid()
    TenantOverride.objects.create(tenant="t2", component="worker")
    the_scope = {
        "all": AllTenants(),
        "only_t1": OnlyTenant("t1"),
        "except_t2": AllTenantsExcept("worker"),
    }[scope]
    Job.objects.filter(name=OTHER, priority=5, tenant="t1").update(attempts=2)  # over the cap
    queue.pause("queue", "q2", by="alice")
    queue.pause("tenant", "t2", by="alice")
    requests = [ClaimRequest(OTHER, 3, 2), ClaimRequest(NOOP, 2)]
    eligible = Job.objects.filter(
        state="queued", queue="q1", tenant="t1", run_after__lte=db_now()
    ).exclude(name=OTHER, attempts__gte=2)

    def expected(name, limit):
        rows = eligible.filter(name=name).order_by("-priority", "run_after", "id")
        return list(rows.values_list("id", flat=True)[:limit])

    want = expected(OTHER, 3) + expected(NOOP, 2)
    if via == "claim":
        got = queue.claim(requests, scope=the_scope, worker="w")
    else:
        queue.enqueue(NewJob("test.third.v1"))
        [third] = queue.claim([ClaimRequest("test.third.v1", 1)], scope=AllTenants())
        report, got = queue.record_and_claim(
            [Outcome.succeeded(third)], requests, scope=the_scope, worker="w"
        )
        assert report.applied == (third.id,)

    assert [j.id for j in got] == want
    assert want  # the grid leaves something to claim


@pytest.mark.django_db(transaction=True)
def test_no_claim_started_after_the_pause_committed_takes_a_paused_job(claim_form):
    """Claimers on their own connections race a pause; every claim statement issued after
    pause() returned (committed) takes nothing of the paused type."""
    # Enough that claims of one job at a time cannot take them all before the pause, on a
    # loaded machine too: the test needs paused jobs left queued.
    queue.enqueue_many([NewJob(NOOP) for _ in range(400)])
    queue.enqueue_many([NewJob(OTHER) for _ in range(400)])
    committed = threading.Event()
    stop = threading.Event()
    walk = claim_form == "walk"

    def claimer() -> list[tuple[bool, list[str]]]:
        if walk:
            connection.ensure_connection()
            connection.pg_version = 170000
        seen = []
        while not stop.is_set():
            after = committed.is_set()
            got = claim((NOOP, OTHER), limit=1)
            seen.append((after, [j.name for j in got]))
            if not got and after:
                break
        return seen

    claimers = [Thread(claimer) for _ in range(4)]
    for t in claimers:
        t.start()
    wait_for(
        lambda: Job.objects.filter(state="running").exists(), what="claims under way", timeout=20
    )
    queue.pause("job_type", NOOP, by="alice")
    committed.set()
    try:
        wait_for(lambda: not any(t.is_alive() for t in claimers), timeout=20, what="claimers")
    finally:
        stop.set()
    results = [t.result() for t in claimers]

    late = [names for seen in results for after, names in seen if after]
    assert late, "some claims ran after the pause"
    assert all(NOOP not in names for names in late)
    assert Job.objects.filter(name=NOOP, state="queued").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["queue", "tenant"])
@pytest.mark.parametrize("value", ["emails ", " emails", "two words", "x" * 65])
def test_a_pause_that_can_never_match_is_refused(kind, value):
    """pauses.validate promises to refuse 'a value that could never name anything'; queues
    and tenants are keys (jobs.core.limits.validate_key) at enqueue."""
    queue.enqueue(NewJob(NOOP, **{kind: "emails"}))
    with pytest.raises(ValueError):
        queue.pause(kind, value, by="alice")


NAME = "test.flow.v1"


def put(tenant: str, count: int, name: str = NAME, **fields) -> None:
    queue.enqueue_many([NewJob(name, {}, tenant=tenant, **fields) for _ in range(count)])


def take(limits, asked, *, scope=None, after=None, cap=None, name=NAME):
    return queue.claim(
        [ClaimRequest(name, asked, cap)],
        scope=scope or AllTenants(),
        limits={name: limits},
        after=after,
    )


@pytest.mark.django_db
def test_a_throttle_never_shortens_or_ends_an_operator_pause():
    assert queue.pause("job_type", NAME, by="operator", reason="maintenance")
    assert queue.throttle(NAME, 0.01) is None
    (row,) = queue.paused()
    assert (row.paused_by, row.until, row.reason) == ("operator", None, "maintenance")


@pytest.mark.django_db
def test_an_operator_pause_replaces_a_throttle_and_lasts():
    assert queue.throttle(NAME, 0.2) is not None
    assert queue.pause("job_type", NAME, by="operator")  # it was only throttled
    assert not queue.pause("job_type", NAME, by="operator")  # now it is paused
    (row,) = queue.paused()
    assert (row.paused_by, row.until) == ("operator", None)


@pytest.mark.django_db
def test_a_throttle_only_lengthens_and_ends_by_itself():
    limits = FlowLimits(global_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 1)
    long = queue.throttle(NAME, 60)
    assert queue.throttle(NAME, 0.01) is None  # shorter: the longer one stands
    assert take(limits, 1) == []
    Pause.objects.filter(value=NAME).update(until=long - timedelta(seconds=61))
    assert queue.paused() == []
    assert len(take(limits, 1)) == 1


@pytest.mark.django_db
def test_resuming_a_type_whose_throttle_has_ended_reports_it_was_not_paused():
    queue.throttle(NAME, 0.05)
    wait_for(lambda: not queue.paused(), timeout=5, what="the throttle ended")

    assert queue.resume("job_type", NAME) is False
