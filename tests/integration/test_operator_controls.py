"""Pause and resume, cancel of running jobs, and the attempt log, through the queue and an
in-process worker on real PostgreSQL."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from jobs import enqueue, queue
from jobs.conf import NOTIFY_CHANNEL
from jobs.models import Job, Pause
from jobs.queue import ClaimRequest, NewJob, Outcome, attempts
from jobs.queue.types import AllTenants
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.support.factories import JobFactory
from tests.support.polling import wait_for
from tests.support.worker import Recorder, Step, registry


def outcomes_counted(job_type: str, kind: str) -> float:
    labels = {"job_type": job_type, "outcome": kind}
    return REGISTRY.get_sample_value("jobs_outcomes_total", labels) or 0.0


NOOP = "test.noop.v1"


def claim(names=(NOOP,), limit=100):
    return queue.claim([ClaimRequest(n, limit) for n in names], scope=AllTenants(), worker="w1")


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
