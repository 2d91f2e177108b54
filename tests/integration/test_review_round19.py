"""Review round 19: the workflows feature (batches, dependencies) attacked.

Each test either proved a defect (it failed on the code before its fix) or covers an attack
that held and that the existing suites do not exercise.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from jobs import Payload, queue
from jobs.models import Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob
from jobs.queue import batches as queue_batches
from jobs.queue.types import InvalidJob
from tests.integration.test_effects import wait_until, waiting_on_a_lock
from tests.support.workflows import settle

UP, DOWN, REPORT = "test.noop.v1", "test.after.v1", "test.report.v1"


class Noop(Payload, name="test.review19.noop.v1"):
    pass


def enqueue(name: str = UP, **fields) -> int:
    """Enqueue one job; its dependency checks run as its commit would run them."""
    id_ = queue.enqueue(NewJob(name=name, **fields)).id
    settle()
    return id_


def claim(name: str = UP, count: int = 100):
    return queue.claim([ClaimRequest(name, count)], scope=AllTenants())


def chain(length: int, **head_fields) -> tuple[int, int]:
    """A head job and ``length`` jobs each waiting for the one before; (head, tail)."""
    head = prev = enqueue(**head_fields)
    for _ in range(length):
        prev = enqueue(DOWN, after=(prev,))
    return head, prev


def run_both(first, second, *, then_when=waiting_on_a_lock, release=None) -> list[BaseException]:
    """Run two bodies in threads (own connections); once ``then_when`` holds, set ``release``."""
    errors: list[BaseException] = []

    def body(target):
        try:
            target()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(t,)) for t in (first, second)]
    for thread in threads:
        thread.start()
    if release is not None:
        wait_until(then_when, what="the second session waits for a lock")
        release.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a test thread did not finish in time"
    return errors


# -- 1. The settle trigger recurses once per link of a chain --------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("end", ["fail", "cancel"])
def test_a_failure_at_the_head_of_a_long_chain_ends_the_whole_chain(end):
    head, tail = chain(500)
    if end == "fail":
        [job] = claim()
        assert queue.fail(job, code="rejected")
    else:
        assert queue.cancel([head], by="operator") == [head]
    settle()  # the release after the head ended, to the end of the chain
    assert Job.objects.get(pk=tail).state == "cancelled"
    assert Job.objects.get(pk=tail).last_error == "dependency_failed"


@pytest.mark.django_db
def test_an_exhausted_chain_head_does_not_wedge_the_exhaustion_pass_for_others():
    head, _tail = chain(500, max_attempts=1)
    unrelated = enqueue(max_attempts=1)
    assert len(claim()) == 2
    Job.objects.filter(pk__in=[head, unrelated]).update(
        lease_expires_at=timezone.now() - timedelta(minutes=1)
    )
    try:
        with transaction.atomic():
            queue.fail_exhausted()
    except OperationalError:
        pass  # the head's own failure may be refused; the unrelated job's must not be
    assert Job.objects.get(pk=unrelated).state == "failed"


# -- 2. Lock order: job rows first in outcomes, the batch row first in add() ------------------


def _member_adds_a_child_waiting_for_its_sibling(batch_id: int, sibling: int, added, go):
    def body():
        with transaction.atomic():
            # The batch row is locked from here to the commit (batches.add).
            queue_batches.add(batch_id, [NewJob(name=DOWN, payload={"n": 1})])
            added.set()
            go.wait(10)
            # ...and then the sibling's job row (dependencies.lock).
            queue_batches.add(batch_id, [NewJob(name=DOWN, after=(sibling,))])

    return body


@pytest.mark.django_db(transaction=True)
def test_adding_a_member_that_waits_for_a_sibling_does_not_deadlock_the_siblings_outcome():
    # The add holds the batch's row to its commit, where it locks the sibling it waits for;
    # the worker's pass holds the sibling's row and wants the batch's. The pass never waits
    # for the batch's row: the sibling's outcome is busy until the add commits, then written.
    batch_id = queue_batches.open(None)
    [sibling] = queue_batches.add(batch_id, [NewJob(name=UP)])
    [held] = claim()
    added, go = threading.Event(), threading.Event()
    reports = []

    def adder():
        with transaction.atomic():
            queue_batches.add(batch_id, [NewJob(name=DOWN, after=(sibling.id,))])
            added.set()
            go.wait(10)

    def worker_outcome():
        added.wait(10)
        while True:
            report, _ = queue.record_and_claim(
                [queue.Outcome.succeeded(held)], [], scope=AllTenants(), count=False
            )
            reports.append(report)
            if report.applied:
                return
            go.set()  # the add may commit now: its batch row held the outcome back

    errors = run_both(adder, worker_outcome)
    assert not errors, [str(e).splitlines()[0] for e in errors]
    assert reports[0].busy == (held.id,) and reports[-1].applied == (held.id,)
    settle()
    state = queue_batches.get(batch_id)
    assert (state.succeeded, state.total) == (1, 2)
    assert Job.objects.get(name=DOWN).waiting_on == 0


def _running(job):
    from jobs.catalogue.registry import JobType, Policy
    from jobs.worker.execution import Running, make_context

    job_type = JobType(Noop, lambda payload, ctx: None, Policy())
    return Running(job, job_type, make_context(job, job_type))


@pytest.mark.django_db(transaction=True)
def test_outcome_statements_over_members_of_two_batches_that_deadlock_are_written_again():
    # The settle trigger locks batch rows in the order the statement updates members, so two
    # outcome statements meeting two batches in opposite orders can deadlock; PostgreSQL
    # aborts one, and the worker writes that one's outcomes again one by one, each of which
    # takes one batch row: every outcome ends written as it was, none failed.
    from jobs.worker.completer import write_one_by_one

    deadlocks: list[OperationalError] = []
    for _round in range(200):
        x, y, fill_a, fill_b = (queue_batches.open(None) for _ in range(4))
        # Ids ascending in this order, so each statement meets its two batches in one order
        # whether it follows the outcomes' order or the ids'.
        [a] = queue_batches.add(x, [NewJob(name=UP)])
        [b] = queue_batches.add(y, [NewJob(name=UP)])
        filler_a = [r.id for r in queue_batches.add(fill_a, [NewJob(name=UP)] * 50)]
        filler_b = [r.id for r in queue_batches.add(fill_b, [NewJob(name=UP)] * 50)]
        [c] = queue_batches.add(y, [NewJob(name=UP)])
        [d] = queue_batches.add(x, [NewJob(name=UP)])
        held = {job.id: job for job in claim(count=1000)}
        orders = [[a.id, *filler_a, c.id], [b.id, *filler_b, d.id]]  # X..Y and Y..X
        barrier = threading.Barrier(2)

        def write(index, held=held, orders=orders, barrier=barrier):
            outcomes = [
                (_running(held[i]), queue.Outcome.succeeded(held[i], None)) for i in orders[index]
            ]
            barrier.wait(5)
            try:
                queue.record([outcome for _, outcome in outcomes])
            except OperationalError as exc:  # as the worker's pass falls back
                deadlocks.append(exc)
                report, _ = write_one_by_one(outcomes)
                assert len(report.applied) == len(outcomes)

        errors = run_both(lambda: write(0), lambda: write(1))
        assert not errors
        ids = [i for order in orders for i in order]
        assert set(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {"succeeded"}
        assert [queue_batches.get(b).succeeded for b in (x, y)] == [2, 2]
        if deadlocks:
            break
    # Whether a round deadlocked depends on timing; when none did, the statements alone
    # wrote everything, which the assertions above checked as well.


@pytest.mark.django_db(transaction=True)
def test_a_deadlocked_outcome_is_written_as_it_was_not_turned_into_a_failure():
    # A transaction that added to a batch holds its row to the commit; waiting for a sibling
    # afterwards deadlocks with the sibling's outcome. Whichever PostgreSQL aborts, the
    # outcome ends written as the handler's, not as a failure.
    from jobs.worker.completer import write_one_by_one

    batch_id = queue_batches.open(None)
    [sibling] = queue_batches.add(batch_id, [NewJob(name=Noop.job_name)])
    [held] = claim(Noop.job_name)
    running = _running(held)
    written = []
    added, go = threading.Event(), threading.Event()

    def worker_outcome():
        added.wait(10)
        outcome = queue.Outcome.succeeded(held, None)
        written.extend(write_one_by_one([(running, outcome)])[1])

    adder = _member_adds_a_child_waiting_for_its_sibling(batch_id, sibling.id, added, go)
    errors = run_both(adder, worker_outcome, release=go)
    assert all("deadlock detected" in str(e) for e in errors), errors  # the adder's, if any
    [(_, outcome)] = written
    assert outcome.state == "succeeded", outcome.detail
    if Job.objects.get(pk=held.id).state == "running":
        # Put off (the row was still locked by the adder when tried again): the next pass
        # writes it.
        report, _ = write_one_by_one([(running, outcome)])
        assert report.applied == (held.id,)
    assert Job.objects.get(pk=held.id).state == "succeeded"


# -- 3. Enqueue's deadlock retry reuses the first attempt's reckoning -----------------------


@pytest.mark.django_db(transaction=True)
def test_a_waiting_job_enqueued_again_after_a_deadlock_is_due_once_nothing_is_left():
    old = enqueue(REPORT, job_id="publish-7")
    [done] = claim(REPORT)
    assert queue.complete(done)
    u, v = enqueue(), enqueue()
    held = {job.id: job for job in claim()}
    key_let_go = threading.Event()
    go = threading.Event()
    result = {}

    def other_session():
        with transaction.atomic(), connection.cursor() as cur:
            # Uncommitted: the enqueue's insert of this key waits for this transaction...
            cur.execute("UPDATE jobs_job SET key_held = FALSE WHERE id = %s", [old])
            key_let_go.set()
            go.wait(10)
            # ...which waits for a row the enqueue locked: the enqueue is the victim, retries.
            cur.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR UPDATE", [u])
            assert queue.complete(held[u]) and queue.complete(held[v])

    def enqueuer():
        key_let_go.wait(10)
        result["id"] = enqueue(DOWN, job_id="publish-7", after=(u, v))

    errors = run_both(other_session, enqueuer, release=go)
    assert not errors, errors
    row = Job.objects.get(pk=result["id"])
    assert row.waiting_on == 0  # both succeeded before the retry read them
    assert row.run_after <= timezone.now(), f"waiting_on=0 but due {row.run_after}"


# -- 4. Batch successors ------------------------------------------------------------------


@pytest.mark.django_db
def test_a_successor_whose_key_holder_has_expired_is_enqueued_afresh():
    old = enqueue(REPORT, job_id="nightly-report")
    [job] = claim(REPORT)
    assert queue.complete(job)
    Job.objects.filter(pk=old).update(finished_at=timezone.now() - timedelta(days=30))
    # enqueue() would let the expired holder go and insert a new job under the key.
    batch_id = queue_batches.open(NewJob(name=REPORT, job_id="nightly-report"))
    queue_batches.add(batch_id, [NewJob(name=UP)])
    queue_batches.seal(batch_id)
    [member] = claim()
    assert queue.complete(member)
    state = queue_batches.get(batch_id)
    assert state.fired_at is not None
    assert state.successor_pk != old
    assert Job.objects.get(pk=state.successor_pk).state == "queued"


@pytest.mark.django_db
def test_firing_is_final_a_member_replayed_before_the_successor_ran_moves_the_counts_only():
    # docs/workflows.md: once the batch fired, its successor is enqueued and runs (it is not
    # held back by a replay); the replayed member moves the counts and fires nothing again.
    batch_id = queue_batches.open(NewJob(name=REPORT))
    queue_batches.add(batch_id, [NewJob(name=UP), NewJob(name=UP)])
    queue_batches.seal(batch_id)
    good, bad = claim()
    queue.complete(good)
    queue.fail(bad, code="rejected")
    fired = queue_batches.get(batch_id)
    assert queue.replay([bad.id], by="operator").replayed == (bad.id,)
    state = queue_batches.get(batch_id)
    assert (state.finished, state.failed) == (1, 0)
    [successor] = claim(REPORT)
    assert successor.id == fired.successor_pk
    [again] = claim()
    queue.complete(again)
    after = queue_batches.get(batch_id)
    assert (after.succeeded, after.failed, after.successor_pk) == (2, 0, fired.successor_pk)
    assert Job.objects.filter(name=REPORT).count() == 1


# -- 5. What after= resolves ------------------------------------------------------------------


@pytest.mark.django_db
def test_after_a_job_id_whose_holder_window_has_passed_is_not_its_old_success():
    # A holder whose window has passed lets its key go to the next job enqueued under it:
    # waiting for its weeks-old success would wait for the wrong job. The name is refused
    # (after= names jobs enqueued before the call; a job of the same call by its result).
    old = enqueue(job_id="render-42")
    [job] = claim()
    queue.complete(job)
    Job.objects.filter(pk=old).update(finished_at=timezone.now() - timedelta(days=30))
    with pytest.raises(InvalidJob, match="no job holds job_id 'render-42'"):
        queue.enqueue_many(
            [NewJob(name=UP, job_id="render-42"), NewJob(name=DOWN, after=("render-42",))]
        )
    assert not Job.objects.filter(name=DOWN).exists()
    render = queue.enqueue(NewJob(name=UP, job_id="render-42"))
    assert render.created and render.id != old
    publish = queue.enqueue(NewJob(name=DOWN, after=("render-42",)))
    assert Job.objects.get(pk=publish.id).waiting_on == 1


@pytest.mark.django_db
def test_after_refuses_a_row_id_of_another_tenant():
    other = enqueue(tenant="tenant-b")
    with pytest.raises(InvalidJob):
        enqueue(DOWN, tenant="tenant-a", after=(other,))


# -- Attacks that held ------------------------------------------------------------------------


@pytest.mark.django_db
def test_one_success_releases_a_thousand_waiting_jobs_at_once():
    top = enqueue()
    waiting = [r.id for r in queue.enqueue_many([NewJob(name=DOWN, after=(top,))] * 1000)]
    assert Job.objects.filter(pk__in=waiting, waiting_on=1).count() == 1000
    [job] = claim()
    assert queue.complete(job)
    settle()  # the release after the outcome
    assert len(claim(DOWN, 2000)) == 1000


@pytest.mark.django_db
def test_a_failed_member_replayed_from_the_history_is_counted_again_before_the_fire():
    batch_id = queue_batches.open(NewJob(name=REPORT))
    [member] = queue_batches.add(batch_id, [NewJob(name=UP)])
    [job] = claim()
    queue.fail(job, code="rejected")
    Job.objects.filter(pk=member.id).update(key_held=False)
    queue.history.archive(now=timezone.now() + timedelta(days=1))
    assert JobHistory.objects.filter(pk=member.id).exists()
    assert queue_batches.get(batch_id).failed == 1

    assert queue.replay([member.id], by="operator").replayed == (member.id,)
    assert queue_batches.get(batch_id).failed == 0
    assert queue_batches.seal(batch_id) is False  # the replayed member holds it open
    [again] = claim()
    assert queue.complete(again)
    state = queue_batches.get(batch_id)
    assert (state.succeeded, state.failed) == (1, 0) and state.fired_at is not None
    assert Job.objects.filter(name=REPORT).count() == 1


@pytest.mark.django_db
def test_a_member_waiting_for_a_failed_job_settles_a_sealed_batch_inside_add():
    up = enqueue()
    [job] = claim()
    queue.fail(job, code="rejected")
    batch_id = queue_batches.open(NewJob(name=REPORT))
    queue_batches.seal(batch_id)  # empty: fired already
    late = queue_batches.open(NewJob(name=REPORT, payload={"late": True}))
    [member] = queue_batches.add(late, [NewJob(name=DOWN, after=(up,))])
    assert Job.objects.get(pk=member.id).state == "cancelled"
    assert queue_batches.seal(late) is True
    assert queue_batches.get(late).cancelled == 1
