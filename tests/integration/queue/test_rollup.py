"""The console's history: outcome writes add to the rollup, compaction keeps every figure.

Every statement that ends an attempt (outcome writes, the worker's passes, in-process
retries, sweeps, cancels) counts it once, as the state it wrote; a rollup that cannot be
written costs its counts, never an outcome, a sweep or the worker; compaction folds UTC
hours and reads only the rows it folds; folds and outcome writes never wait on each other;
quantiles stay within a bucket.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import JobContext, Payload, RetryAfter, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.db.clock import database_now
from jobs.models import BacklogSample, Job, Rollup
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    attempts,
    rollup,
    rollup_compaction,
    rollup_reads,
    statements,
)
from jobs.scheduler.retention import Retention
from jobs.testing import run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.runapp.jobs import DeliverV1
from tests.runapp.models import Delivery
from tests.support.factories import JobFactory
from tests.support.polling import wait_for
from tests.support.worker import (
    Echo,
    Hostile,
    Recorder,
    hostile_registry,
    refusing_trigger,
    run_until,
    settled,
)

pytestmark = pytest.mark.django_db

NAME = "test.noop.v1"


def claim(count: int = 1, names=(NAME,)):
    return queue.claim([ClaimRequest(n, count) for n in names], scope=AllTenants())


def totals(since=None) -> Counter[tuple[str, str, str]]:
    """Attempts per (name, outcome, code) in every row of the rollup."""
    now = database_now()
    found = rollup_reads.bins(
        since or now - timedelta(days=60), now + timedelta(minutes=1), timedelta(days=1)
    )
    counted: Counter[tuple[str, str, str]] = Counter()
    for item in found:
        counted[(item.name, item.outcome, item.code)] += item.count
    return counted


def set_times(job_id: int, *, ran: float, waited: float) -> None:
    """Make a claimed row look due ``waited`` s before it started, ``ran`` s ago."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE jobs_job SET started_at = statement_timestamp() - make_interval(secs => %s),"
            " run_after = statement_timestamp() - make_interval(secs => %s) WHERE id = %s",
            [ran, ran + waited, job_id],
        )


def test_each_written_outcome_counts_once_per_type_outcome_and_code():
    JobFactory.create_batch(6)
    jobs = claim(6)
    done, failed, retried, handed_back, stale, fresh = jobs
    for job in jobs:
        set_times(job.id, ran=3.0, waited=2.0)

    report = queue.record(
        [
            Outcome.succeeded(done),
            Outcome.failed(failed, code="handler_error", detail="boom"),
            Outcome.retry(retried, code="timeout", delay=60),
            Outcome.released(handed_back),
            Outcome.succeeded(fresh),
        ]
    )
    assert len(report.applied) == 5
    # A fenced outcome (a token the row no longer holds) changes nothing and counts nothing.
    Job.objects.filter(pk=stale.id).update(claim_token=None, state="queued")
    assert not queue.complete(stale)

    assert totals() == {
        (NAME, "succeeded", ""): 2,
        (NAME, "failed", "handler_error"): 1,
        (NAME, "retried", "timeout"): 1,
    }
    [succeeded] = [
        b for b in rollup_reads.bins(*_window(), timedelta(hours=1)) if b.outcome == "succeeded"
    ]
    assert succeeded.run.n == succeeded.wait.n == 2
    assert succeeded.run_seconds == pytest.approx(6.0, abs=0.5)
    assert succeeded.wait_seconds == pytest.approx(4.0, abs=0.1)
    # Both attempts' figures fall in the bucket of 3 s and 2 s: the quantiles say so.
    assert succeeded.run.quantile(0.5) == pytest.approx(3.0, rel=0.42)
    assert succeeded.wait.quantile(0.95) == pytest.approx(2.0, rel=0.42)


def _window():
    now = database_now()
    return now - timedelta(hours=1), now + timedelta(minutes=1)


def test_the_worker_pass_counts_what_it_writes():
    JobFactory.create_batch(3)
    first = claim(2)
    report, claimed = queue.record_and_claim(
        [Outcome.succeeded(first[0]), Outcome.failed(first[1], code="handler_error")],
        [ClaimRequest(NAME, 5)],
        scope=AllTenants(),
    )
    assert len(report.applied) == 2 and len(claimed) == 1
    assert totals() == {(NAME, "succeeded", ""): 1, (NAME, "failed", "handler_error"): 1}


def test_sweeps_and_cancels_count_as_the_attempts_they_end():
    now = database_now()
    JobFactory(
        running=True, attempts=1, max_attempts=3, lease_expires_at=now - timedelta(seconds=5)
    )
    JobFactory(
        running=True, attempts=3, max_attempts=3, lease_expires_at=now - timedelta(seconds=5)
    )
    queued = JobFactory()
    assert len(queue.requeue_expired()) == 1
    assert len(queue.fail_exhausted()) == 1
    assert queue.cancel([queued.pk], by="alice") == [queued.pk]

    assert totals() == {
        (NAME, "retried", "lease_expired"): 1,
        (NAME, "failed", "lease_expired"): 1,
        (NAME, "cancelled", "cancelled"): 1,
    }
    # An expired attempt's run time is unknown: only its queue latency is in the histograms.
    for item in rollup_reads.bins(*_window(), timedelta(hours=1)):
        assert item.run.n == 0
        assert item.wait.n == (0 if item.outcome == "cancelled" else 1)


@pytest.mark.django_db(transaction=True)
def test_two_sessions_finishing_the_same_type_never_wait_on_each_other():
    JobFactory.create_batch(2)
    first, second = claim(2)
    written = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def hold_open() -> None:
        try:
            with transaction.atomic():
                assert queue.complete(first)
                written.set()  # its rollup row is written and locked until the commit
                assert release.wait(30)
        except BaseException as error:  # reported to the test below
            errors.append(error)
            written.set()
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_open)
    holder.start()
    try:
        assert written.wait(30)
        with connection.cursor() as cur:  # a wait on the other session's row would fail fast
            cur.execute("SET lock_timeout = '2s'")
        assert queue.complete(second)  # would block on a shared rollup row
    finally:
        release.set()
        holder.join(30)
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")
    assert not errors
    assert totals() == {(NAME, "succeeded", ""): 2}
    assert Rollup.objects.filter(outcome="succeeded").values("shard").distinct().count() == 2


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.floats(min_value=0, max_value=10_000, allow_nan=False), max_size=40))
def test_the_statement_buckets_values_as_the_reader_does(values):
    """PostgreSQL's width_bucket and Distribution.of agree on every value."""
    Rollup.objects.all().delete()
    with connection.cursor() as cur:
        cur.execute(
            "WITH "
            + rollup.cte(
                "SELECT %s::text, 'succeeded', '', v, v FROM unnest(%s::float8[]) AS v",
            )
            + f" SELECT 1 WHERE {rollup.reads()}",
            [NAME, values],
        )
    found = rollup_reads.bins(*_window(), timedelta(hours=1))
    if not values:
        assert found == []
        return
    [item] = found
    assert item.count == len(values)
    assert item.run == item.wait == rollup.Distribution.of(values)
    assert item.run_seconds == pytest.approx(sum(values))


def insert_rows(rows) -> None:
    """Place rollup rows at past minutes (the outcome statement writes only the current one)."""
    with connection.cursor() as cur:
        for period, width, name, outcome, shard, count, histogram in rows:
            cur.execute(
                "INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count,"
                " run_seconds, wait_seconds, run_histogram, wait_histogram)"
                " VALUES (%s, %s, %s, %s, '', %s, %s, %s, %s, %s, %s)",
                [
                    period,
                    width,
                    name,
                    outcome,
                    shard,
                    count,
                    float(count),
                    2.0 * count,
                    histogram,
                    list(reversed(histogram)),
                ],
            )


row_keys = st.tuples(
    st.integers(min_value=0, max_value=6 * 60),  # minutes back
    st.sampled_from(["a.v1", "b.v1"]),
    st.sampled_from(["succeeded", "failed"]),
    st.sampled_from([0, 101, 202]),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.dictionaries(
        row_keys,
        st.lists(
            st.integers(min_value=0, max_value=50), min_size=rollup.BUCKETS, max_size=rollup.BUCKETS
        ),
        max_size=30,
    )
)
def test_compaction_keeps_every_count_and_histogram(rows):
    Rollup.objects.all().delete()
    now = database_now().replace(second=30, microsecond=0)
    minute = now.replace(second=0)
    insert_rows(
        (minute - timedelta(minutes=back), rollup.MINUTE, name, outcome, shard, sum(hist), hist)
        for (back, name, outcome, shard), hist in rows.items()
    )

    def figures():
        found = rollup_reads.bins(
            now - timedelta(days=1), now + timedelta(hours=1), timedelta(hours=1)
        )
        return {
            (b.start, b.name, b.outcome): (b.count, b.run, b.wait, round(b.wait_seconds, 6))
            for b in found
        }

    before = figures()
    rollup_compaction.compact(now, batch_size=7, max_batches=100)
    assert figures() == before
    left = list(Rollup.objects.values_list("period", "width", "shard"))
    assert all(
        width == rollup.HOUR or period >= now - rollup.MINUTES_KEPT for period, width, _ in left
    )
    assert all(shard == 0 or period >= now - rollup.SHARD_FOLD_AFTER for period, _, shard in left)
    rollup_compaction.compact(now, batch_size=7, max_batches=100)  # a second pass changes nothing
    assert figures() == before


def test_retention_folds_old_rows_and_deletes_expired_ones():
    now = database_now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    empty = [0] * rollup.BUCKETS
    insert_rows(
        [
            (hour - timedelta(days=31), rollup.HOUR, NAME, "succeeded", 0, 1, empty),
            (hour - timedelta(days=29), rollup.HOUR, NAME, "succeeded", 0, 2, empty),
            (hour - timedelta(hours=3), rollup.MINUTE, NAME, "succeeded", 7, 4, empty),
        ]
    )
    rollup.record_backlog([(NAME, 10, 5, 3.0)], at=hour - timedelta(hours=3, minutes=-1))
    rollup.record_backlog([(NAME, 30, 1, None)], at=hour - timedelta(hours=3, minutes=-2))
    rollup.record_backlog([(NAME, 20, 2, 9.0)], at=hour - timedelta(days=31))

    counts = Retention().run_once(now=now)

    assert counts["jobs.rollup:expired"] == 2
    assert sorted(Rollup.objects.values_list("width", "shard", "count")) == [
        (rollup.HOUR, 0, 2),
        (rollup.HOUR, 0, 4),
    ]
    [sample] = BacklogSample.objects.all()
    assert (sample.width, sample.queued, sample.due, sample.oldest_due_seconds) == (
        rollup.HOUR,
        30,
        5,
        3.0,
    )


def test_a_later_backlog_sample_in_the_same_minute_replaces_the_earlier():
    now = database_now().replace(second=5)
    rollup.record_backlog([(NAME, 10, 5, 3.0), ("other.v1", 0, 0, None)], at=now)
    rollup.record_backlog([(NAME, 8, 2, 4.0)], at=now + timedelta(seconds=20))
    points = rollup_reads.backlog_points(
        now - timedelta(hours=1), now + timedelta(hours=1), timedelta(hours=1)
    )
    assert [(p.name, p.queued, p.due, p.oldest_due_seconds) for p in points] == [
        ("other.v1", 0, 0, None),
        (NAME, 8, 2, 4.0),
    ]


def test_the_gauges_duty_samples_the_backlog():
    from jobs.scheduler.gauges import Gauges

    JobFactory.create_batch(3)
    Gauges({NAME, "idle.v1"}).run_once()
    samples = dict(BacklogSample.objects.values_list("name", "queued"))
    assert samples == {NAME: 3, "idle.v1": 0}


@given(
    st.lists(st.floats(min_value=0.001, max_value=2900, allow_nan=False), min_size=1, max_size=200),
    st.sampled_from([0.5, 0.9, 0.95, 0.99]),
)
def test_a_quantile_read_from_the_histogram_is_within_a_bucket_of_the_true_one(values, q):
    estimate = rollup.Distribution.of(values).quantile(q)
    exact = sorted(values)[max(0, math.ceil(q * len(values)) - 1)]
    assert estimate is not None
    assert exact / math.sqrt(2) * 0.999 <= estimate <= exact * math.sqrt(2) * 1.001


def test_bins_refuse_a_step_that_is_not_whole_minutes():
    with pytest.raises(ValueError, match="whole number of minutes"):
        rollup_reads.bins(*_window(), timedelta(seconds=90))


def test_the_writers_bucket_bounds_are_the_readers():
    """jobs_rollup_add buckets run and wait times by the bounds the console reads them by."""
    functions = statements.FOLDER / "functions"
    text = (functions / "jobs_rollup_add.sql").read_text()
    ran, waited = re.findall(r"width_bucket\(e\.\w+, '\{([^}]*)\}'::float8\[\]\)", text)
    assert ran == waited
    assert [float(bound) for bound in ran.split(",")] == list(rollup.BOUNDS)
    histogram = (functions / "jobs_histogram_of.sql").read_text()
    assert f"array_fill(0, ARRAY[{rollup.BUCKETS}])" in histogram


def test_a_pass_that_counts_its_own_attempts_writes_no_rollup_row():
    JobFactory.create_batch(2)
    first = claim(1)
    report, claimed = queue.record_and_claim(
        [Outcome.succeeded(first[0])], [ClaimRequest(NAME, 5)], scope=AllTenants(), count=False
    )
    assert report.applied == (first[0].id,) and len(claimed) == 1
    assert not queue.record([Outcome.succeeded(claimed[0])], count=False).fenced
    assert totals() == {}


@pytest.mark.django_db(transaction=True)
def test_a_running_worker_adds_its_attempts_about_once_a_second_and_the_rest_at_stop():
    from jobs import enqueue
    from jobs.worker.config import WorkerConfig
    from jobs.worker.runner import Worker
    from tests.support.polling import wait_for
    from tests.support.worker import Recorder, Step, registry

    recorder = Recorder()
    for _ in range(5):
        enqueue(Step(plan=("ok",)))
    enqueue(Step(plan=("reject",)))
    worker = Worker(registry(recorder), WorkerConfig(install_signal_handlers=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        # Written while the worker runs on, idle: not only at its stop.
        wait_for(lambda: sum(totals().values()) == 6, timeout=10, what="the attempts in the rollup")
        counted = totals()
        enqueue(Step(plan=("ok",)))
        wait_for(
            lambda: recorder.calls and len(recorder.calls) == 7, what="the last job ran", timeout=20
        )
    finally:
        worker.request_stop()
        thread.join(10)
    assert counted == {
        (Step.job_name, "succeeded", ""): 5,
        (Step.job_name, "failed", "rejected"): 1,
    }
    # The last attempt is added at the clean stop if not before.
    assert totals()[(Step.job_name, "succeeded", "")] == 6
    [item] = [
        b for b in rollup_reads.bins(*_window(), timedelta(hours=1)) if b.outcome == "succeeded"
    ]
    assert item.run.n == item.wait.n == 6


attempt_items = st.lists(
    st.tuples(
        st.sampled_from(["succeeded", "failed", "retried", "cancelled"]),
        st.sampled_from(["", "handler_error", "x" * 40]),
        st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
        st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
    ),
    max_size=30,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(attempt_items)
def test_a_writers_tally_adds_up_as_the_statement_would(items):
    """The worker's path (a Tally written by add()) and the statement's (jobs_rollup_add over
    the same attempts) leave the same figures."""

    def figures():
        found = rollup_reads.bins(*_window(), timedelta(hours=1))
        return {
            (b.outcome, b.code): (b.count, b.run, b.wait, round(b.run_seconds, 3)) for b in found
        }

    Rollup.objects.all().delete()
    tally = rollup.Tally()
    for outcome, code, ran, waited in items:
        tally.add((NAME, outcome, code, ran, waited))
    rollup.add(tally)
    by_tally = figures()
    Rollup.objects.all().delete()
    if items:
        outcomes, codes, ran, waited = (list(column) for column in zip(*items, strict=True))
        with connection.cursor() as cur:
            cur.execute(
                "WITH "
                + rollup.cte(
                    "SELECT %s::text, o, c, r, w FROM unnest(%s::text[], %s::text[],"
                    " %s::float8[], %s::float8[]) AS u(o, c, r, w)"
                )
                + f" SELECT 1 WHERE {rollup.reads()}",
                [NAME, outcomes, codes, ran, waited],
            )
    assert figures() == by_tally


def every_row_totals() -> Counter[tuple[str, str, str]]:
    """Attempts per (name, outcome, code) over every rollup row, whatever its period."""
    with connection.cursor() as cur:
        cur.execute("SELECT name, outcome, code, sum(count) FROM jobs_rollup GROUP BY 1, 2, 3")
        return Counter({(n, o, c): int(k) for n, o, c, k in cur.fetchall()})


def every_bin(step=timedelta(hours=1)) -> list[rollup.Bin]:
    now = database_now()
    return rollup_reads.bins(now - timedelta(days=40), now + timedelta(hours=2), step)


def row_of(pk: int) -> Job:
    return Job.objects.get(pk=pk)


class Thread(threading.Thread):
    """A thread on its own connection that re-raises its error on ``result()``."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.error: BaseException | None = None
        self.value = None

    def run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 15):
        self.join(timeout)
        assert not self.is_alive(), "a test thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


def insert_row(
    period,
    *,
    width=rollup.MINUTE,
    name=NAME,
    outcome="succeeded",
    code="",
    shard=0,
    count=1,
    run=None,
    wait=None,
):
    run = run or [0] * rollup.BUCKETS
    wait = wait or [0] * rollup.BUCKETS
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count,"
            " run_seconds, wait_seconds, run_histogram, wait_histogram)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                period,
                width,
                name,
                outcome,
                code,
                shard,
                count,
                float(count),
                float(count),
                run,
                wait,
            ],
        )


@contextlib.contextmanager
def refusing_rollup():
    """The rollup refuses every write, as it would for a worker role never granted the new
    table (a migration added it; the deployment grants privileges table by table)."""
    with connection.cursor() as cur:
        cur.execute(
            """
            CREATE FUNCTION rollup_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                RAISE EXCEPTION 'permission denied for table jobs_rollup'
                    USING ERRCODE = '42501';
            END $$;
            CREATE TRIGGER rollup_refuse BEFORE INSERT OR UPDATE ON jobs_rollup
                FOR EACH ROW EXECUTE FUNCTION rollup_refuse();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "DROP TRIGGER IF EXISTS rollup_refuse ON jobs_rollup;"
                " DROP FUNCTION IF EXISTS rollup_refuse()"
            )


def lock_rows_elsewhere(ids):
    """Hold FOR UPDATE on job rows in another session; returns (locked, release, thread)."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT id FROM jobs_job WHERE id = ANY(%s) FOR UPDATE", [list(ids)])
            locked.set()
            assert release.wait(15)

    thread = Thread(hold)
    thread.start()
    assert locked.wait(15)
    return release, thread


@pytest.mark.django_db
def test_one_batch_of_every_kind_counts_each_ended_attempt_once():
    """Succeeded, failed, retried, a retry of a cancel-requested attempt (cancelled), a
    success despite a cancel request (succeeded), a hand-back (nothing), a fenced outcome
    (nothing), duplicates of one outcome in a batch (once)."""
    JobFactory.create_batch(7)
    done, failed, retried, asked, asked_done, handed, twice = claim(7)
    assert queue.cancel_running([asked.id, asked_done.id], by="alice") == [
        asked.id,
        asked_done.id,
    ]
    fenced = JobFactory(running=True)
    ghost = replace(done, id=fenced.id, claim_token=uuid.uuid4())  # never this row's
    report = queue.record(
        [
            Outcome.succeeded(done),
            Outcome.failed(failed, code="handler_error", detail="boom"),
            Outcome.retry(retried, code="timeout", delay=60),
            Outcome.retry(asked, code="timeout", delay=60),
            Outcome.succeeded(asked_done),
            Outcome.released(handed),
            Outcome.failed(twice, code="handler_error"),
            Outcome.failed(twice, code="handler_error"),
            Outcome.succeeded(ghost),
        ]
    )
    assert set(report.fenced) == {fenced.id}
    assert every_row_totals() == {
        (NAME, "succeeded", ""): 2,
        (NAME, "failed", "handler_error"): 2,
        (NAME, "retried", "timeout"): 1,
        (NAME, "cancelled", "cancelled"): 1,
    }


@pytest.mark.django_db
def test_a_stale_and_a_fresh_outcome_of_one_job_in_one_batch_count_the_fresh_one():
    JobFactory()
    [first] = claim()
    Job.objects.filter(pk=first.id).update(lease_expires_at=database_now() - timedelta(seconds=1))
    assert len(queue.requeue_expired()) == 1  # counted: retried / lease_expired
    [second] = claim()
    assert second.id == first.id and second.claim_token != first.claim_token

    report = queue.record([Outcome.succeeded(first), Outcome.failed(second, code="handler_error")])
    assert report.applied == (second.id,) and report.fenced == (first.id,)
    assert every_row_totals() == {
        (NAME, "retried", "lease_expired"): 1,
        (NAME, "failed", "handler_error"): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_a_busy_outcome_counts_once_when_it_is_written_later():
    JobFactory.create_batch(2)
    busy, free = claim(2)
    release, holder = lock_rows_elsewhere([busy.id])
    try:
        report = queue.record([Outcome.succeeded(busy), Outcome.succeeded(free)])
        assert report.busy == (busy.id,) and report.applied == (free.id,)
        assert every_row_totals() == {(NAME, "succeeded", ""): 1}
    finally:
        release.set()
        holder.result()
    report = queue.record([Outcome.succeeded(busy)])
    assert report.applied == (busy.id,)
    assert every_row_totals() == {(NAME, "succeeded", ""): 2}


@pytest.mark.django_db(transaction=True)
def test_an_outcome_in_a_transaction_that_rolls_back_counts_nothing():
    JobFactory()
    [job] = claim()

    class Undo(Exception):
        pass

    with contextlib.suppress(Undo), transaction.atomic():
        assert queue.complete(job)
        assert every_row_totals() == {(NAME, "succeeded", ""): 1}
        raise Undo
    assert every_row_totals() == {}
    assert queue.complete(job)
    assert every_row_totals() == {(NAME, "succeeded", ""): 1}


@pytest.mark.django_db
def test_a_handed_back_cancel_requested_job_is_counted_cancelled():
    """At shutdown the worker hands back jobs no handler has started. One an operator had asked
    to stop is not requeued: the write ends it ``cancelled`` (jobs.queue.outcomes,
    ``free.state``), and the rollup counts that end, though it skips every other hand-back
    (``ran_attempt``): the console's cancelled total agrees with the jobs table (a cancel of a
    queued job, which ran nothing either, is counted too).
    """
    JobFactory()
    [job] = claim()
    assert queue.cancel_running([job.id], by="alice") == [job.id]
    report = queue.release([job])
    assert report.applied == (job.id,)
    assert row_of(job.id).state == "cancelled"
    assert every_row_totals() == {(NAME, "cancelled", "cancelled"): 1}


@pytest.mark.django_db
def test_replay_and_run_now_count_nothing():
    failed = JobFactory(failed=True)
    later = JobFactory(run_after=database_now() + timedelta(hours=1))
    assert queue.replay([failed.id], by="alice").replayed == (failed.id,)
    assert queue.run_now([later.id]) == [later.id]
    assert every_row_totals() == {}


@pytest.mark.django_db
def test_odd_names_and_long_codes_are_counted_as_written():
    name = ("ü'\"\\%s;" * 40)[:200]
    JobFactory(name=name)
    [job] = claim(names=(name,))
    long_code = "x" * 31 + "é" + "tail that is cut"
    assert queue.fail(job, code=long_code, detail="d")
    assert every_row_totals() == {(name, "failed", long_code[:32]): 1}


@pytest.mark.django_db
def test_one_statement_of_hundreds_of_outcomes_of_many_types():
    names = [f"rollup.many.{k}.v1" for k in range(30)]
    for name in names:
        JobFactory.create_batch(10, name=name)
    jobs = claim(10, names=names)
    assert len(jobs) == 300
    outcomes, expected = [], Counter()
    for k, job in enumerate(jobs):
        kind = k % 4
        if kind == 0:
            outcomes.append(Outcome.succeeded(job))
            expected[(job.name, "succeeded", "")] += 1
        elif kind == 1:
            outcomes.append(Outcome.failed(job, code=f"code_{k % 7}"))
            expected[(job.name, "failed", f"code_{k % 7}")] += 1
        elif kind == 2:
            outcomes.append(Outcome.retry(job, code="timeout", delay=30))
            expected[(job.name, "retried", "timeout")] += 1
        else:
            outcomes.append(Outcome.released(job))
    report = queue.record(outcomes)
    assert len(report.applied) == 300
    assert every_row_totals() == expected
    assert sum(b.run.n for b in every_bin()) == sum(expected.values())


class WaitOnceV1(Payload, name="rollup.wait_once.v1"):
    """Raises RetryAfter(seconds) on its first attempt, succeeds on the next."""

    seconds: float = 0.05


class WaitOnceAsyncV1(Payload, name="rollup.wait_once_async.v1"):
    seconds: float = 0.05


def wait_once(payload: WaitOnceV1, ctx: JobContext) -> dict:
    if ctx.attempt == 1:
        raise RetryAfter(payload.seconds)
    return {"attempt": ctx.attempt}


async def wait_once_async(payload: WaitOnceAsyncV1, ctx: JobContext) -> dict:
    if ctx.attempt == 1:
        raise RetryAfter(payload.seconds)
    return {"attempt": ctx.attempt}


def waiting_registry() -> Registry:
    policy = Policy(max_attempts=3, timeout=timedelta(seconds=10))
    return Registry(
        [
            JobType(WaitOnceV1, wait_once, policy),
            JobType(WaitOnceAsyncV1, wait_once_async, policy),
            JobType(Echo, lambda payload, ctx: payload.text, Policy(concurrency=4)),
        ]
    )


@pytest.mark.django_db(transaction=True)
def test_the_worker_pass_counts_every_job_it_finishes():
    ids = [enqueue(Echo(text=f"e{i}")).id for i in range(12)]
    run_worker(registry=waiting_registry(), concurrency=4)
    assert {row_of(pk).state for pk in ids} == {"succeeded"}
    assert every_row_totals() == {(Echo.job_name, "succeeded", ""): 12}


@pytest.mark.django_db(transaction=True)
def test_the_run_model_transaction_path_counts_each_attempt():
    from tests.runapp.jobs import deliver

    deliveries = [Delivery.objects.create(job_id=f"d-{i}") for i in range(3)]
    for row in deliveries:
        enqueue(DeliverV1(run_id=row.pk, plan=("error", "ok")))
    policy = Policy(run_model=Delivery, max_attempts=3, backoff=queue_backoff())
    run_worker(registry=Registry([JobType(DeliverV1, deliver, policy)]))
    assert every_row_totals() == {
        (DeliverV1.job_name, "retried", "handler_error"): 3,
        (DeliverV1.job_name, "succeeded", ""): 3,
    }


def queue_backoff():
    from jobs.catalogue.registry import Backoff

    return Backoff(base=0.01, cap=0.05)


@pytest.mark.django_db(transaction=True)
def test_outcomes_written_one_by_one_count_once():
    """A batch the database refuses is rolled back whole and rewritten one by one: the
    refused outcome counts once as the failure it became, the others once each."""
    recorder = Recorder()
    with refusing_trigger("results saying refuse-me are refused", "check_violation"):
        ok = [queue.enqueue(NewJob(Hostile.job_name, {"action": "ok"})).id for _ in range(6)]
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "refuse-me"})).id
        run_until(
            hostile_registry(recorder), lambda w: settled(*ok, poison) and w.idle, concurrency=8
        )
    assert row_of(poison).state == "failed"
    assert every_row_totals() == {
        (Hostile.job_name, "succeeded", ""): 6,
        (Hostile.job_name, "failed", "handler_error"): 1,
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(WaitOnceV1(seconds=120.0), id="queued-retry-sync"),
        pytest.param(WaitOnceAsyncV1(seconds=120.0), id="queued-retry-async"),
        pytest.param(WaitOnceV1(seconds=0.05), id="in-process-sync"),
        pytest.param(WaitOnceAsyncV1(seconds=0.05), id="in-process-async"),
    ],
)
def test_an_in_process_retry_is_counted(payload):
    """The same handler raising the same RetryAfter: with a delay above RETRY_IN_PROCESS_UP_TO
    the retry goes back to the queue and counts ``retried``; with a short one it is waited out
    in the worker (jobs.queue.renewal.next_attempt), whose statement logs the ended attempt as a
    retry in the attempt log and counts it in the rollup too. The console's history shows
    each attempt the job ran, and the failure rate of a type that retries in process is not
    read as 0 %.
    """
    done = enqueue(payload)
    if payload.seconds > 60:
        run_worker(registry=waiting_registry())
        Job.objects.filter(pk=done.id).update(run_after=database_now())  # skip the wait
    run_worker(registry=waiting_registry())
    job = row_of(done.id)
    assert (job.state, job.attempts) == ("succeeded", 2)
    assert [a.outcome for a in attempts.of(job)] == ["retry", "succeeded"]
    assert every_row_totals() == {
        (payload.job_name, "retried", "handler_error"): 1,
        (payload.job_name, "succeeded", ""): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_queue_latency_after_an_in_process_wait_leaves_the_wait_out():
    """Queue latency is "the attempt's start minus the time it became due". A job due now,
    claimed at once, raising RetryAfter(1.5): its second attempt became due when the wait
    ended and started right then, so the rollup records no queue latency for the wait
    (started_at moves to the second attempt's start, and so does the time it became due). A
    type that retries in process does not look like one starved by the queue.
    """
    done = enqueue(WaitOnceV1(seconds=1.5))
    run_worker(registry=waiting_registry())
    assert row_of(done.id).state == "succeeded"
    [item] = [b for b in every_bin() if b.name == WaitOnceV1.job_name and b.outcome == "succeeded"]
    assert item.wait.n == 1
    assert item.wait_seconds < 0.5, f"queue latency {item.wait_seconds:.2f}s"


@pytest.mark.django_db
def test_sweeps_count_each_branch_as_the_state_it_writes():
    now = database_now()
    expired = now - timedelta(seconds=5)
    retry = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    asked_retry = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    last = JobFactory(running=True, attempts=3, max_attempts=3, lease_expires_at=expired)
    asked_last = JobFactory(running=True, attempts=3, max_attempts=3, lease_expires_at=expired)
    over = JobFactory(attempts=3, max_attempts=3)  # queued, no attempt left: never ran again
    lowered = JobFactory(attempts=2, max_attempts=5)  # the type's limit lowered to 2
    fresh = JobFactory(running=True, attempts=1)  # lease still good: untouched
    Job.objects.filter(pk__in=[asked_retry.id, asked_last.id]).update(
        cancel_requested_at=now, cancel_requested_by="alice"
    )

    assert {r.id for r in queue.requeue_expired()} == {retry.id, asked_retry.id}
    assert {r.id for r in queue.fail_exhausted(max_attempts={NAME: 2})} == {
        last.id,
        asked_last.id,
        over.id,
        lowered.id,
    }
    assert row_of(fresh.id).state == "running"
    assert every_row_totals() == {
        (NAME, "retried", "lease_expired"): 1,
        (NAME, "failed", "lease_expired"): 1,
        (NAME, "failed", "attempts_exhausted"): 2,
        (NAME, "cancelled", "cancelled"): 2,
    }
    # A swept attempt has no run time; one that was queued has no queue latency either.
    for item in every_bin():
        assert item.run.n == 0
        assert item.wait.n == (0 if item.code == "attempts_exhausted" else item.count)


@pytest.mark.django_db
def test_a_cancel_counts_queued_jobs_only_and_once():
    queued = JobFactory.create_batch(3)
    running = JobFactory(running=True)
    ids = [j.id for j in queued] + [running.id]
    cancelled, asked = queue.cancel_active(ids, by="alice", running=True)
    assert sorted(cancelled) == sorted(j.id for j in queued) and asked == [running.id]
    assert queue.cancel(ids, by="bob") == []  # a second cancel ends nothing
    assert every_row_totals() == {(NAME, "cancelled", "cancelled"): 3}


@pytest.mark.django_db
def test_a_refused_rollup_costs_its_counts_never_the_outcome():
    """A rollup that cannot be written is skipped (with a server-side warning): the outcome
    around it is written and reported applied, and nothing is counted."""
    JobFactory()
    [job] = claim()
    with refusing_rollup():
        assert queue.complete(job)
    assert row_of(job.id).state == "succeeded"
    assert every_row_totals() == {}


@pytest.mark.django_db
def test_a_refused_rollup_does_not_stop_recovery_of_dead_workers_jobs():
    """The sweeps carry the rollup CTE too. While it fails (a privilege not granted on the table,
    the function missing, a lock or statement timeout on jobs_rollup), requeue_expired and
    fail_exhausted still requeue or fail the jobs of a dead worker: invariant 5 (no job is
    lost) does not depend on the console's charts.
    """
    expired = database_now() - timedelta(seconds=5)
    dead = JobFactory(running=True, attempts=1, max_attempts=3, lease_expires_at=expired)
    with refusing_rollup():
        with contextlib.suppress(DatabaseError), transaction.atomic():
            queue.requeue_expired()
        assert row_of(dead.id).state == "queued", "the dead worker's job stays running"


@pytest.mark.django_db(transaction=True)
def test_a_refused_rollup_does_not_wedge_the_worker():
    """The pass's statement carries the rollup too. When the rollup refuses every write, the
    handler that ran and succeeded still ends its job ``succeeded``: the worker does not write
    the outcomes one by one (each failing), replace each with a handler_error failure (failing
    too), then give the job up to its lease, whose sweep fails as well, leaving the job
    ``running`` for good. Losing a count is the lesser harm.
    """
    ids = [enqueue(Echo(text=f"e{i}")).id for i in range(3)]
    with refusing_rollup():
        config = WorkerConfig(
            poll_interval=0.05, install_signal_handlers=False, lease=timedelta(seconds=1)
        )
        worker = Worker(waiting_registry(), config)
        thread = Thread(worker.run)
        thread.start()
        try:
            wait_for(
                lambda: all(row_of(pk).state != "queued" for pk in ids),
                what="the jobs claimed",
                timeout=15,
            )
            # Well past the lease: both the outcome and the recovery had their chance.
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline and not settled(*ids):
                time.sleep(0.05)
        finally:
            worker.request_stop(force=True)
            thread.result()
        states = [row_of(pk).state for pk in ids]
    assert states == ["succeeded"] * 3, states


def epoch_rows() -> list[tuple[int, int, str, str, int, int]]:
    """(period as epoch seconds, width, outcome, code, shard, count), in key order."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT extract(epoch FROM period)::bigint, width, outcome, code, shard, count"
            " FROM jobs_rollup ORDER BY 1, 2, 3, 4, 5"
        )
        return cur.fetchall()


def utc_hour_back(hours: int) -> int:
    """The epoch of the UTC hour ``hours`` before this one."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT extract(epoch FROM date_trunc('hour', statement_timestamp(), 'UTC'))::bigint"
        )
        return cur.fetchone()[0] - hours * 3600


def at_epoch(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


@pytest.mark.django_db
def test_compaction_keeps_codes_and_merges_split_hours_into_present_hour_rows():
    """One hour's minute rows in several codes and shards, some already folded into the hour
    row by an earlier pass (an hour row present), folded in batches of 2: every count of
    every code lands in that hour once; rows exactly at the cut-offs stay as they are."""
    now = database_now().replace(microsecond=0)
    hour = utc_hour_back(4)
    insert_row(at_epoch(hour), width=rollup.HOUR, outcome="failed", code="timeout", count=5)
    for minute, code, shard in [
        (0, "timeout", 11),
        (7, "timeout", 12),
        (7, "oom", 11),
        (59, "", 0),
        (30, "oom", 0),
    ]:
        insert_row(
            at_epoch(hour + 60 * minute),
            code=code,
            shard=shard,
            count=minute + 1,
            outcome="failed" if code else "succeeded",
        )
    cut_hours = (now - rollup.MINUTES_KEPT).replace(second=0)
    cut_shards = (now - rollup.SHARD_FOLD_AFTER).replace(second=0)
    if cut_hours.timestamp() >= cut_shards.timestamp():  # pragma: no cover - constants
        pytest.skip("cut-offs overlap")
    insert_row(cut_shards, shard=33, count=100)  # at the shard cut-off: not yet folded
    now = cut_shards + rollup.SHARD_FOLD_AFTER  # exactly the cut-off
    rollup_compaction.compact(now, batch_size=2, max_batches=50)
    rows = epoch_rows()
    assert (int(cut_shards.timestamp()), rollup.MINUTE, "succeeded", "", 33, 100) in rows
    folded = {(o, c): n for p, w, o, c, s, n in rows if p == hour and w == rollup.HOUR}
    assert folded == {
        ("failed", "timeout"): 5 + 1 + 8,
        ("failed", "oom"): 8 + 31,
        ("succeeded", ""): 60,
    }
    assert all(
        p >= int((now - rollup.MINUTES_KEPT).timestamp()) for p, w, *_ in rows if w == rollup.MINUTE
    )


@pytest.mark.django_db
@override_settings(USE_TZ=False, TIME_ZONE="Asia/Kolkata")
def test_the_hour_fold_keeps_utc_hours_outside_utc():
    """``date_trunc('hour', m.period)`` would use the session's TimeZone, which Django sets to
    TIME_ZONE when USE_TZ is False (supported: test_enqueue.py). In Asia/Kolkata (+05:30) an
    attempt that ended at 10:05 UTC must fold into the hour row of 10:00 UTC, the bin every
    reader shows it in (bins() bins by the epoch, in UTC), not into one of 09:30 UTC, which the
    minute chart and the day chart after compaction would place in different hours.
    """
    hour = utc_hour_back(4)
    insert_row(at_epoch(hour + 5 * 60), shard=7, count=3)
    rollup_compaction.compact(database_now())
    [(period, width, *_rest)] = epoch_rows()
    assert width == rollup.HOUR
    assert period == hour, f"folded into the hour of {at_epoch(period):%H:%M} UTC"


@pytest.mark.django_db
def test_backlog_fold_keeps_each_hours_largest_across_batches():
    hour = utc_hour_back(5)
    samples = [(3, 10, 1, 2.0), (17, 4, 9, None), (44, 7, 2, 30.0), (59, 1, 0, 1.0)]
    for minute, queued, due, oldest in samples:
        rollup.record_backlog([(NAME, queued, due, oldest)], at=at_epoch(hour + 60 * minute))
    rollup.record_backlog([(NAME, 99, 99, 99.0)], at=at_epoch(hour + 3600))  # the next hour
    rollup_compaction.compact(database_now(), batch_size=1, max_batches=50)
    points = rollup_reads.backlog_points(at_epoch(hour), at_epoch(hour + 7200), timedelta(hours=1))
    assert [(p.queued, p.due, p.oldest_due_seconds) for p in points] == [
        (10, 9, 30.0),
        (99, 99, 99.0),
    ]


THIRTY_DAYS_OF_HOURS = """
INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count, run_seconds,
                         wait_seconds, run_histogram, wait_histogram)
SELECT date_trunc('hour', statement_timestamp(), 'UTC') - (h + 3) * interval '1 hour', 3600,
       'type.' || n || '.v1', o, '', 0, 1, 1, 1, array_fill(0, ARRAY[45]),
       array_fill(0, ARRAY[45])
FROM generate_series(0, 24 * 30 - 4) AS h, generate_series(1, 40) AS n,
     unnest(ARRAY['succeeded', 'failed', 'retried']) AS o
"""


# The last two hours of minute rows (folded into shard 0) and this minute's per-session rows.
RECENT_MINUTES = """
INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count, run_seconds,
                         wait_seconds, run_histogram, wait_histogram)
SELECT date_trunc('minute', statement_timestamp()) - m * interval '1 minute', 60,
       'type.' || n || '.v1', 'succeeded', '', CASE WHEN m < 3 THEN 4242 ELSE 0 END, 1, 1, 1,
       array_fill(0, ARRAY[45]), array_fill(0, ARRAY[45])
FROM generate_series(0, 121) AS m, generate_series(1, 40) AS n
"""


def blocks_of(plan: dict) -> int:
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


@pytest.mark.django_db
def test_a_steady_state_fold_reads_only_minute_rows():
    """30 days of hour rows for 40 types (86,000 rows), two hours of minute rows: a retention
    pass has a minute's worth of rows to fold, and no fold statement (shards, hours; the
    backlog table's likewise) reads every page of the table on every pass. The scheduler's
    loop has a statement timeout, which a fold that grows with the table would outgrow on a
    large deployment, never to run again.
    """
    with connection.cursor() as cur:
        cur.execute(THIRTY_DAYS_OF_HOURS)
        cur.execute(RECENT_MINUTES)
        cur.execute("ANALYZE jobs_rollup")
        cur.execute("SELECT pg_relation_size('jobs_rollup') / current_setting('block_size')::int")
        (pages,) = cur.fetchone()
    plans: list[tuple[str, dict]] = []

    def explain(execute, sql, params, many, context):
        if sql.lstrip().startswith("WITH moved AS") and "jobs_rollup" in sql:
            with connection.cursor() as cur:
                cur.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params)
                plans.append((sql, cur.fetchone()[0][0]["Plan"]))
        return execute(sql, params, many, context)

    now = database_now()
    with connection.execute_wrapper(explain):  # each fold runs twice: explained, then as is
        rollup_compaction.compact(now)
    # Some per-session rows were old enough to fold; this minute's were not.
    assert 40 <= Rollup.objects.filter(width=rollup.MINUTE, shard=4242).count() < 3 * 40
    assert len(plans) == 2  # the shard fold and the hour fold, one statement each
    read = [blocks_of(plan) for _sql, plan in plans]
    assert max(read) < pages // 5, f"fold statements read {read} of {pages} pages"


def backend_pid() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_an_open_fold_and_an_outcome_write_never_wait_on_each_other():
    """A fold that deleted this worker's old per-session rows and holds its transaction
    open does not stall the worker's outcome write; nor does a worker's open outcome
    transaction stall a fold. Each side runs under a short lock_timeout."""
    JobFactory.create_batch(2)
    first, second = claim(2)
    pid = backend_pid()
    old = database_now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    insert_row(old, shard=pid, count=4)  # this session's rows of ten minutes ago
    folded, release = threading.Event(), threading.Event()

    def fold_and_hold():
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '1s'")
            rollup_compaction.compact(database_now())
            folded.set()
            assert release.wait(15)

    holder = Thread(fold_and_hold)
    holder.start()
    try:
        assert folded.wait(15)
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '1s'")
        assert queue.complete(first)  # a wait on the fold's rows would time out
    finally:
        release.set()
        holder.result()
    assert every_row_totals() == {(NAME, "succeeded", ""): 5}

    written, release = threading.Event(), threading.Event()

    def write_and_hold():
        with transaction.atomic():
            assert queue.complete(second)
            written.set()
            assert release.wait(15)

    holder = Thread(write_and_hold)
    holder.start()
    try:
        assert written.wait(15)
        rollup_compaction.compact(database_now() + timedelta(minutes=5))  # folds every minute row
    finally:
        release.set()
        holder.result()
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")
    assert every_row_totals() == {(NAME, "succeeded", ""): 6}


def test_quantiles_of_degenerate_histograms():
    empty = rollup.Distribution()
    assert empty.quantile(0.5) is None
    fast = rollup.Distribution.of([0.0, 0.0002, -0.5, 0.0009])  # all below 1 ms (bucket 0)
    assert all(0 < fast.quantile(q) <= rollup.BOUNDS[0] for q in (0.01, 0.5, 0.99, 1.0))
    one = rollup.Distribution.of([3.0])
    assert rollup.BOUNDS[23] <= one.quantile(0.5) <= one.quantile(1.0) <= rollup.BOUNDS[24]
    with pytest.raises(ValueError):
        one.quantile(0)
    merged = rollup_reads.summed(
        [
            rollup.Bin(at_epoch(0), NAME, "succeeded", "", 2, 1.0, 1.0, fast, fast),
            rollup.Bin(at_epoch(60), NAME, "succeeded", "", 1, 3.0, 0.0, one, empty),
        ]
    )
    assert (merged.count, merged.run_seconds, merged.run.n, merged.wait.n) == (3, 4.0, 5, 4)
    assert rollup_reads.summed([]) is None


def test_quantiles_of_runs_of_hours_stay_within_a_bucket():
    """Jobs that run for hours (exports, backfills) all fall in the open last bucket, where
    Distribution.quantile does not return its lower bound, 2,966 s, for every q (the
    performance page would show p50 = p95 = 49 min for a type whose every run took three
    hours): the bin's run_seconds total knows better (its mean is 3 h).
    """
    three_hours = 3 * 3600.0
    runs = rollup.Distribution.of([three_hours] * 10)
    assert runs.quantile(0.5) == pytest.approx(three_hours, rel=0.2)
