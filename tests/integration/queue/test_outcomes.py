"""Fenced outcomes: only the holder of the current claim token changes a job.

On every outcome path (``record()`` counted and not, the pass statement and the pass
functions) any mix of stale and current outcomes, duplicates included, writes the last
current outcome and nothing stale, and reports each outcome applied, fenced or busy (a row
another session holds locked) as ``jobs.queue.outcomes`` promises; of two outcomes of one
attempt the later wins, in the functions too, for the workers of a previous release.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jobs
from jobs import queue
from jobs.models import Job
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    OutcomeReport,
    flow,
)
from jobs.queue import outcomes as outcomes_module
from jobs.queue.flow import FlowLimits
from tests.support.concurrency import Background
from tests.support.factories import JobFactory
from tests.support.noop_jobs import SCOPE, claim, enqueue

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


@pytest.mark.django_db
@pytest.mark.parametrize("stale_first", [True, False], ids=["stale-first", "fresh-first"])
@pytest.mark.parametrize("write", ["record", "record_and_claim"])
def test_a_stale_outcome_in_the_batch_is_fenced_by_its_token(stale_first, write):
    """A worker can hold a stale attempt and a fresh claim of one job at once (runner._held is
    keyed by (id, token)); both outcomes may land in one pass. Only the one whose token holds
    the row may be written; the stale one is fenced."""
    enqueue(1)
    [fresh] = claim(1)
    stale = dataclasses.replace(fresh, claim_token=uuid.uuid4())
    outcomes = [Outcome.failed(stale, code="stale_attempt"), Outcome.succeeded(fresh, {"ok": 1})]
    if not stale_first:
        outcomes.reverse()

    if write == "record":
        report = queue.record(outcomes)
    else:
        report, _ = queue.record_and_claim(outcomes, [], scope=SCOPE)

    job = Job.objects.get(pk=fresh.id)
    assert (job.state, job.last_error, job.result) == ("succeeded", "", {"ok": 1})
    # One outcome applied, one fenced (reported by id, so the id appears once in each).
    assert (report.applied, report.fenced) == ((fresh.id,), (fresh.id,))


@pytest.mark.django_db
def test_a_batch_mixing_naive_and_aware_retry_times_is_written():
    """Outcome's constructors promise one outcome cannot make a batch fail to write: retry
    times naive and aware in one batch are each written as the session's time."""
    enqueue(2)
    first, second = claim(2)
    at = datetime(2030, 1, 1, 12, 0)
    outcomes = [
        Outcome.retry(first, code="later", at=at.replace(tzinfo=UTC)),
        Outcome.retry(second, code="later", at=at),  # naive: the session's zone (UTC)
    ]

    report = queue.record(outcomes)

    assert report.applied == (first.id, second.id)
    assert set(Job.objects.values_list("run_after", flat=True)) == {at.replace(tzinfo=UTC)}


NAME = "hostile.a.v1"


def _claimed():
    from jobs import queue
    from jobs.queue import AllTenants, ClaimRequest

    jobs.queue.enqueue(NewJob(NAME, {"n": 1}))
    [job] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants())
    return job


@pytest.mark.django_db
def test_an_outcome_whose_token_is_the_tokens_text_is_written():
    """An Outcome built by hand with the claim token as text (the field is annotated UUID) is
    written: such a list goes to psycopg as a text[] that ``::uuid[]`` casts, rather than to
    the struct encoder, which would fail the whole batch."""
    from jobs.queue import Outcome

    job = _claimed()
    report = jobs.queue.record([Outcome(job.id, str(job.claim_token), "succeeded")])
    assert Job.objects.get(pk=job.id).state == "succeeded", report


JOB_NAME = "test.job.v1"


# Nothing is ever queued under these: a pass that writes outcomes and claims nothing.
IDLE = "test.job.idle.v1"


FAIR_IDLE = "test.job.fair.v1"


FAIR = {FAIR_IDLE: FlowLimits(fair=True)}


BY = "operator@test"


FUNCTIONS = {
    "pass function": "SELECT * FROM jobs_worker_pass_v3(",
    "fair pass function": "SELECT * FROM jobs_worker_fair_pass_v3(",
}


PATHS = ("record", "record uncounted", "pass statement", *FUNCTIONS)


@pytest.fixture
def fair_gate():
    flow.ensure(FAIR)


def claim_job(limit: int = 1) -> list[queue.ClaimedJob]:
    return queue.claim([ClaimRequest(JOB_NAME, limit)], scope=SCOPE, worker="w27")


def write(path: str, batch: list[Outcome]) -> OutcomeReport:
    """``batch`` written by one of the outcome paths; the functions are checked to be called."""
    with CaptureQueriesContext(connection) as statements:
        if path in ("record", "record uncounted"):
            report = queue.record(batch, count=path == "record")
        elif path == "pass statement":
            report, claimed = queue.record_and_claim(
                batch, [ClaimRequest(IDLE, 3)], scope=SCOPE, count=True
            )
            assert claimed == []
        else:
            name, limits = (IDLE, None) if path == "pass function" else (FAIR_IDLE, FAIR)
            report, claimed = queue.record_and_claim(
                batch, [ClaimRequest(name, 3)], scope=SCOPE, count=False, limits=limits
            )
            assert claimed == []
    if path in FUNCTIONS:
        [sent] = [s["sql"] for s in statements]
        assert sent.startswith(FUNCTIONS[path]), sent
    return report


def written_as(job_id: int) -> tuple[str, str, Any]:
    row = Job.objects.get(pk=job_id)
    return (row.state, row.last_error, row.result)


@pytest.mark.django_db
@pytest.mark.parametrize("order", ["succeeded then failed", "failed then succeeded"])
@pytest.mark.parametrize("path", list(FUNCTIONS))
def test_a_previous_release_worker_still_gets_the_later_of_two_outcomes_written(
    fair_gate, monkeypatch, path, order
):
    """A worker of the previous release calls the same function with the outcomes as they
    are (its ``outcome_params`` did not reduce them): during a rolling deploy 0022/0023 are
    in place under it. The function must write the later of two outcomes of one attempt,
    whole, as the report (and the worker's run rows, synced in order) take both as applied:
    not the earlier, nor a mix of the later's state with the earlier's error, detail and
    result."""
    monkeypatch.setattr(outcomes_module, "_last_of_each_attempt", lambda outcomes: outcomes)
    queue.enqueue(NewJob(JOB_NAME, {}))
    [job] = claim_job()
    pair = [Outcome.succeeded(job, {"ok": 1}), Outcome.failed(job, code="late", detail="x")]
    batch = pair if order.startswith("succeeded") else pair[::-1]
    later = ("failed", "late", None) if batch[-1] is pair[1] else ("succeeded", "", {"ok": 1})

    report = write(path, batch)

    assert report.applied == (job.id, job.id)
    assert written_as(job.id) == later


def _reclaimed() -> tuple[queue.ClaimedJob, queue.ClaimedJob]:
    """A job whose first attempt's lease was lost and that was claimed again: the stale and
    the current claim."""
    queue.enqueue(NewJob(JOB_NAME, {}))
    [stale] = claim_job()
    Job.objects.filter(pk=stale.id).update(
        state="queued", claim_token=None, lease_expires_at=None, claimed_by=""
    )
    [current] = claim_job()
    assert current.claim_token != stale.claim_token
    return stale, current


KINDS: dict[str, Callable[[queue.ClaimedJob], Outcome]] = {
    "succeeded": lambda job: Outcome.succeeded(job, {"done": job.attempts}),
    "failed": lambda job: Outcome.failed(job, code="boom", detail="d"),
    "retry": lambda job: Outcome.retry(job, code="later", delay=timedelta(minutes=5)),
    "released": Outcome.released,
    "cancelled": Outcome.cancelled,
}


class Locker:
    """Another session holding a row ``FOR UPDATE`` until :meth:`release`."""

    def __init__(self, job_id: int):
        self._locked, self._release = threading.Event(), threading.Event()

        def hold() -> None:
            with transaction.atomic():
                list(Job.objects.select_for_update().filter(pk=job_id).values_list("id"))
                self._locked.set()
                assert self._release.wait(30), "never released"

        self._thread = Background(hold)
        assert self._locked.wait(30), "the other session never locked the row"

    def release(self) -> None:
        self._release.set()
        self._thread.result()


@pytest.mark.django_db(transaction=True)
@example(path="pass function", asked=False, locked=False, batch=[(True, "succeeded")] * 2)
@example(
    path="fair pass function",
    asked=True,
    locked=False,
    batch=[(True, "succeeded"), (False, "failed"), (True, "released")],
)
@example(path="record", asked=False, locked=True, batch=[(False, "succeeded"), (True, "retry")] * 2)
@given(
    path=st.sampled_from(PATHS),
    asked=st.booleans(),
    locked=st.booleans(),
    batch=st.lists(
        st.tuples(st.booleans(), st.sampled_from(sorted(KINDS))), min_size=1, max_size=5
    ),
)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_mix_of_stale_current_and_repeated_outcomes_writes_the_last_current_one(
    fair_gate, path, asked, locked, batch
):
    """Outcomes of a job's stale and current attempts, in any order and repeated, on every
    path: a stale one never writes; the last current one is written (ended cancelled if an
    operator asked and it would not end the job); every current outcome is reported applied
    (or busy while another session holds the row), every stale one fenced."""
    Job.objects.filter(name=JOB_NAME).delete()
    stale, current = _reclaimed()
    if asked:
        Job.objects.filter(pk=current.id).update(
            cancel_requested_at=timezone.now(), cancel_requested_by=BY
        )
    before = Job.objects.filter(pk=current.id).values().get()
    outcomes = [KINDS[kind](current if is_current else stale) for is_current, kind in batch]
    currents = [o for o in outcomes if o.token == current.claim_token]
    locker = Locker(current.id) if locked else None
    try:
        report = write(path, outcomes)
    finally:
        if locker is not None:
            locker.release()
    row = Job.objects.filter(pk=current.id).values().get()
    # One job: the report's tuples name its id once an outcome.
    stales = len(outcomes) - len(currents)
    if locked or not currents:
        assert row == before  # nothing written, least of all a stale outcome
        assert report.applied == () and report.fenced == (current.id,) * stales
        assert report.busy == (current.id,) * len(currents)
        return
    last = currents[-1]
    state = "cancelled" if asked and last.state in ("queued", "cancelled") else last.state
    assert row["state"] == state and row["claim_token"] is None
    assert row["attempts"] == before["attempts"] + last.attempts_delta
    assert row["result"] == (None if last.result_json is None else {"done": current.attempts})
    assert report.applied == (current.id,) * len(currents)
    assert report.fenced == (current.id,) * stales and report.busy == ()
    stopped = asked and last.state in ("queued", "cancelled")
    assert (current.claim_token in report.stopped) == stopped
