"""The console's history: outcome writes add to the rollup, compaction keeps every figure."""

from __future__ import annotations

import importlib
import math
import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import BacklogSample, Job, Rollup
from jobs.queue import AllTenants, ClaimRequest, Outcome, rollup, rollup_compaction, rollup_reads
from jobs.scheduler.retention import Retention
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db

NAME = "test.noop.v1"


def claim(count: int = 1):
    return queue.claim([ClaimRequest(NAME, count)], scope=AllTenants())


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


def test_the_migrations_bounds_are_the_readers():
    migration = importlib.import_module("jobs.migrations.0007_console_rollup")
    frozen = [float(b) for b in migration.BOUNDS.split("'")[1].strip("{}").split(",")]
    assert frozen == list(rollup.BOUNDS)
    assert migration.BUCKETS == rollup.BUCKETS


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
    from tests.acceptance.conftest import wait_for
    from tests.worker_support import Recorder, Step, registry

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
        wait_for(lambda: recorder.calls and len(recorder.calls) == 7, what="the last job ran")
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
