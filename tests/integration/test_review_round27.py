"""Review round 27: the commits after d3b41c4.

* 0412f70 one job is enqueued by ``jobs_enqueue_job`` (migration 0021): the id or NULL, no
  ``ON CONFLICT`` for a keyless job, ``fair`` by ``EXISTS`` on the type's gate row, NOTIFY
  for an inserted, due job; alone and for a single row in the caller's transaction;
* 8b0a90e the outcome write joins ``free`` (which now carries the outcome's values) to the
  table by id alone (inline, and in ``jobs_worker_pass``/``jobs_worker_fair_pass``,
  migrations 0022/0023); two outcomes of one attempt are reduced to the later in Python
  (``outcomes._last_of_each_attempt``) before they are sent;
* 2f44b2e typing only.

Defect found (the test failed on the reviewed code; fixed since):

* ``test_a_previous_release_worker_still_gets_the_later_of_two_outcomes_written``: "the
  later of two outcomes of one attempt wins" was kept by the client alone. The database
  functions 0022/0023 wrote the *earlier* one, whole, when both reached them (the
  ``UPDATE … FROM free`` took the first of two ``free`` rows of one id; which one
  PostgreSQL does not promise), and the report called both applied. The processes of the
  previous release, which the migrations are meant to keep serving during a rolling deploy
  (0021 keeps ``jobs_enqueue_one`` for them), call these functions with both: their
  ``outcome_params`` does not reduce. (Run against 0019/0020's functions, two outcomes of
  one attempt were written as a mix, the later's state with the earlier's code, detail and
  result.) Fixed in the statement: ``o`` keeps the later outcome of each attempt
  (``DISTINCT ON (id, token)`` by ordinality), for any caller.

Pinned here (passing): two sessions enqueuing one key (the first in a transaction that
commits or rolls back; the second alone or in a transaction) leave one row and report
``created`` once; six sessions meeting an expired key holder at once insert one row and
all return it; the single insert announces only an inserted, due job, only with NOTIFY on,
and only at commit; with ``USE_TZ = False`` a single job's due time is its delay after its
creation, alone or in a transaction; ``migrate jobs 0020`` and forward again with
``prepare_threshold = 0`` on the connection that prepared the call leaves enqueue and the
pass working; on every outcome path any mix of stale and current outcomes, duplicates
included, writes the last current outcome and nothing stale, and reports each outcome
applied, fenced or busy (a row another session holds locked) as ``jobs.queue.outcomes``
promises; a keyless single job waiting on another, in the caller's transaction, is gone
with its edge when that transaction rolls back.

Every database test runs on real PostgreSQL; concurrent sessions are real connections in
threads, and waits poll with deadlines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.conf import NOTIFY_CHANNEL
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome, OutcomeReport, flow
from jobs.queue import outcomes as outcomes_module
from jobs.queue.flow import FlowLimits
from tests.support.concurrency import Background
from tests.support.prepared import prepare_threshold

NAME = "test.round27.v1"
# Nothing is ever queued under these: a pass that writes outcomes and claims nothing.
IDLE = "test.round27.idle.v1"
FAIR_IDLE = "test.round27.fair.v1"
FAIR = {FAIR_IDLE: FlowLimits(fair=True)}
SCOPE = AllTenants()
BY = "operator@round27"
FUNCTIONS = {
    "pass function": ("SELECT * FROM jobs_worker_pass_v2(", "0019_worker_pass_busy_when_unwritten"),
    "fair pass function": (
        "SELECT * FROM jobs_worker_fair_pass_v2(",
        "0020_worker_fair_pass_busy_when_unwritten",
    ),
}
PATHS = ("record", "record uncounted", "pass statement", *FUNCTIONS)


@pytest.fixture
def fair_gate():
    flow.ensure(FAIR)


def claim(limit: int = 1) -> list[queue.ClaimedJob]:
    return queue.claim([ClaimRequest(NAME, limit)], scope=SCOPE, worker="r27")


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
        assert sent.startswith(FUNCTIONS[path][0]), sent
    return report


def pass_once(batch: list[Outcome]) -> OutcomeReport:
    """The worker's pass function (no check of the text sent: prepared, it is not logged)."""
    report, claimed = queue.record_and_claim(
        batch, [ClaimRequest(IDLE, 3)], scope=SCOPE, count=False
    )
    assert claimed == []
    return report


def written_as(job_id: int) -> tuple[str, str, Any]:
    row = Job.objects.get(pk=job_id)
    return (row.state, row.last_error, row.result)


# --- Defect (fixed): the functions keep "the later outcome wins" themselves -------------------


@pytest.mark.django_db
@pytest.mark.parametrize("order", ["succeeded then failed", "failed then succeeded"])
@pytest.mark.parametrize("path", list(FUNCTIONS))
def test_a_previous_release_worker_still_gets_the_later_of_two_outcomes_written(
    fair_gate, monkeypatch, path, order
):
    """A worker of the previous release calls the same function with the outcomes as they
    are (its ``outcome_params`` did not reduce them): during a rolling deploy 0022/0023 are
    in place under it. The function must write the later of two outcomes of one attempt,
    whole, as the report (and the worker's run rows, synced in order) take both as applied.
    (As reviewed it wrote the earlier; 0019/0020's functions wrote neither whole: the
    later's state with the earlier's error, detail and result.)"""
    monkeypatch.setattr(outcomes_module, "_last_of_each_attempt", lambda outcomes: outcomes)
    queue.enqueue(NewJob(NAME, {}))
    [job] = claim()
    pair = [Outcome.succeeded(job, {"ok": 1}), Outcome.failed(job, code="late", detail="x")]
    batch = pair if order.startswith("succeeded") else pair[::-1]
    later = ("failed", "late", None) if batch[-1] is pair[1] else ("succeeded", "", {"ok": 1})

    report = write(path, batch)

    assert report.applied == (job.id, job.id)
    assert written_as(job.id) == later


# --- Pinned: outcomes, fencing and duplicates on every path ----------------------------------


def _reclaimed() -> tuple[queue.ClaimedJob, queue.ClaimedJob]:
    """A job whose first attempt's lease was lost and that was claimed again: the stale and
    the current claim."""
    queue.enqueue(NewJob(NAME, {}))
    [stale] = claim()
    Job.objects.filter(pk=stale.id).update(
        state="queued", claim_token=None, lease_expires_at=None, claimed_by=""
    )
    [current] = claim()
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
    Job.objects.filter(name=NAME).delete()
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


# --- Pinned: the single insert under concurrency --------------------------------------------


def _someone_waits_for_a_lock(deadline: float = 10.0) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cur.fetchone()[0]:
                return True
        time.sleep(0.01)
    return False


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("second", ["alone", "in a transaction"])
def test_two_sessions_enqueuing_one_key_leave_one_row(end, second):
    """The first session's insert is not committed yet when the second enqueues the same
    key: the second waits, then returns the first's row (commit) or inserts its own
    (rollback). One key-holding row either way, ``created`` reported once."""
    inserted, finish = threading.Event(), threading.Event()

    def first() -> queue.Enqueued:
        with transaction.atomic():
            enqueued = queue.enqueue(NewJob(NAME, {"who": 1}, job_id="race"))
            inserted.set()
            assert finish.wait(20)
            transaction.set_rollback(end == "rollback")
        return enqueued

    def other() -> queue.Enqueued:
        if second == "alone":
            return queue.enqueue(NewJob(NAME, {"who": 2}, job_id="race"))
        with transaction.atomic():
            return queue.enqueue(NewJob(NAME, {"who": 2}, job_id="race"))

    a = Background(first)
    assert inserted.wait(20)
    b = Background(other)
    assert _someone_waits_for_a_lock()
    finish.set()
    ours, theirs = a.result(), b.result()
    [(id_, payload)] = Job.objects.filter(job_id="race", key_held=True).values_list("id", "payload")
    assert theirs.id == id_
    if end == "commit":
        assert (ours.created, theirs.created, payload) == (True, False, {"who": 1})
        assert ours.id == id_
    else:
        assert (theirs.created, payload) == (True, {"who": 2})
        assert Job.objects.filter(job_id="race").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "in a transaction"])
def test_sessions_meeting_an_expired_key_holder_at_once_insert_one_row(inside):
    old = queue.enqueue(NewJob(NAME, {"old": True}, job_id="expired"))
    Job.objects.filter(pk=old.id).update(
        state="failed", finished_at=timezone.now() - timedelta(days=3650)
    )
    sessions = 6
    barrier = threading.Barrier(sessions)

    def enqueue() -> queue.Enqueued:
        barrier.wait(20)
        if inside:
            with transaction.atomic():
                return queue.enqueue(NewJob(NAME, {}, job_id="expired"))
        return queue.enqueue(NewJob(NAME, {}, job_id="expired"))

    results = [r.result() for r in [Background(enqueue) for _ in range(sessions)]]
    [holder] = Job.objects.filter(job_id="expired", key_held=True).values_list("id", flat=True)
    assert {r.id for r in results} == {holder} and holder != old.id
    assert sum(r.created for r in results) == 1
    assert Job.objects.filter(job_id="expired").count() == 2


# --- Pinned: NOTIFY, time zones, dependencies and the migrations ----------------------------


def _heard(timeout: float = 0.3) -> list[str]:
    return [n.payload for n in connection.connection.notifies(timeout=timeout)]


@pytest.mark.django_db(transaction=True)
def test_the_single_insert_announces_only_an_inserted_due_job_with_notify_on(settings):
    queue.enqueue(NewJob(NAME, {}, job_id="held"))
    with connection.cursor() as cur:
        cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
    try:
        _heard(0.05)
        queue.enqueue(NewJob(NAME, {}))
        assert _heard() == [NAME]
        queue.enqueue(NewJob(NAME, {}, job_id="held"))  # its key is held: nothing inserted
        queue.enqueue(NewJob(NAME, {}, delay=timedelta(seconds=30)))  # not due
        queue.enqueue(NewJob(NAME, {}, run_after=timezone.now() + timedelta(seconds=30)))
        assert _heard() == []
        queue.enqueue(NewJob(NAME, {}, run_after=timezone.now() - timedelta(days=1)))
        assert _heard() == [NAME]
        with transaction.atomic():
            queue.enqueue(NewJob(NAME, {}))
            transaction.set_rollback(True)
        assert _heard() == []
        with transaction.atomic():
            queue.enqueue(NewJob(NAME, {}, job_id="in a transaction"))
        assert _heard() == [NAME]
        settings.JOBS = {**getattr(settings, "JOBS", {}), "NOTIFY": False}
        queue.enqueue(NewJob(NAME, {}))
        assert _heard() == []
    finally:
        with connection.cursor() as cur:
            cur.execute("UNLISTEN *")


@pytest.mark.django_db(transaction=True)
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
@pytest.mark.parametrize("inside", [False, True], ids=["alone", "in a transaction"])
@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_with_use_tz_off_a_single_job_is_due_its_delay_after_its_creation(inside, keyed):
    connection.close()  # the time zone is read at connect
    job = NewJob(NAME, {}, delay=timedelta(hours=1), job_id="tz" if keyed else None)
    if inside:
        with transaction.atomic():
            enqueued = queue.enqueue(job)
    else:
        enqueued = queue.enqueue(job)
    with connection.cursor() as cur:
        cur.execute("SELECT run_after - created_at FROM jobs_job WHERE id = %s", [enqueued.id])
        assert cur.fetchone() == (timedelta(hours=1),)
    connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_single_waiting_job_in_a_rolled_back_transaction_leaves_nothing():
    upstream = queue.enqueue(NewJob(NAME, {}))
    with transaction.atomic():
        waiting = queue.enqueue(NewJob(NAME, {}, after=(upstream.id,)))
        assert Job.objects.get(pk=waiting.id).waiting_on == 1
        transaction.set_rollback(True)
    assert list(Job.objects.values_list("id", flat=True)) == [upstream.id]
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM jobs_dependency")
        assert cur.fetchone() == (0,)


@pytest.mark.django_db(transaction=True)
def test_migrating_back_to_0020_and_forward_with_prepared_calls_leaves_the_queue_working():
    """``prepare_threshold = 0``: the call of ``jobs_enqueue_job`` and the pass are prepared
    on this connection; 0023-0021 are reversed and applied again on it (the function is
    dropped and made anew). Every later call answers; 0018's function stays throughout."""
    with prepare_threshold(0):
        assert queue.enqueue(NewJob(NAME, {})).created
        assert queue.enqueue(NewJob(NAME, {}, job_id="prepared")).created
        pass_once([])
        try:
            call_command("migrate", "jobs", "0020", verbosity=0)
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT proname FROM pg_proc "
                    "WHERE proname IN ('jobs_enqueue_job', 'jobs_enqueue_one')"
                )
                assert [name for (name,) in cur.fetchall()] == ["jobs_enqueue_one"]
        finally:
            call_command("migrate", "jobs", verbosity=0)
        for n in range(3):
            assert queue.enqueue(NewJob(NAME, {"n": n})).created
        assert not queue.enqueue(NewJob(NAME, {}, job_id="prepared")).created
        [job] = claim()
        assert pass_once([Outcome.succeeded(job)]).applied == (job.id,)
