"""Sessions that end jobs, add to batches and enqueue ``after=`` take their locks in one order.

An add to a batch holds the batch's row and, as it commits, locks the jobs its members wait
for; whatever ends or brings back a batch member locks the batch's row before the member's;
the deferred checks of one transaction lock the jobs waited for in id order. No two of these
can deadlock, so no producer's COMMIT and no operator's action fails with one.
"""

from __future__ import annotations

import threading

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from jobs import Payload, queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob
from jobs.queue import batches as queue_batches
from tests.support.concurrency import InThread, Producer, until_waiting, waiting_on_a_lock
from tests.support.polling import wait_for
from tests.support.workflows import settle

UP, DOWN, REPORT = "test.noop.v1", "test.after.v1", "test.report.v1"

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_operators_cancel_of_a_member_and_an_add_waiting_for_it_both_go_through():
    batch = queue_batches.open(None)
    [sibling] = queue_batches.add(batch, [NewJob(name=UP)])
    producer = Producer(
        lambda: queue_batches.add(batch, [NewJob(name=DOWN, after=(sibling.id,))])
    ).start()
    cancel = InThread(lambda: queue.cancel([sibling.id], by="operator"))
    until_waiting()  # the cancel waits for the batch row the add holds
    assert producer.finish() is None
    cancel.join()
    assert cancel.error is None and cancel.result == [sibling.id]


def test_a_producers_commit_waiting_for_a_job_an_operator_cancels_is_never_the_victim():
    """The cancel holds back on a second job another session holds while the add commits."""
    batch = queue_batches.open(None)
    [sibling] = queue_batches.add(batch, [NewJob(name=UP)])
    other = queue.enqueue(NewJob(name=UP)).id
    producer = Producer(
        lambda: queue_batches.add(batch, [NewJob(name=DOWN, after=(sibling.id,))])
    ).start()
    holder = Producer(lambda: list(Job.objects.select_for_update().filter(pk=other))).start()
    cancel = InThread(lambda: queue.cancel([sibling.id, other], by="operator"))
    until_waiting()
    committing = InThread(producer.finish)
    committing.join()
    holder.finish()
    cancel.join()
    assert (committing.result, cancel.error) == (None, None)
    assert sorted(cancel.result) == sorted([sibling.id, other])


def test_two_producers_enqueueing_after_the_same_jobs_in_opposite_orders_both_commit():
    """The checks at each commit lock the jobs waited for in id order, whatever the order of
    the enqueues in the transaction."""
    u1, u2, u3 = (queue.enqueue(NewJob(name=UP)).id for _ in range(3))
    first = Producer(
        lambda: [queue.enqueue(NewJob(name=DOWN, after=(up,))) for up in (u1, u3, u2)]
    ).start()
    second = Producer(
        lambda: [queue.enqueue(NewJob(name=DOWN, after=(up,))) for up in (u2, u1)]
    ).start()
    holder = Producer(lambda: list(Job.objects.select_for_update().filter(pk=u3))).start()
    one = InThread(first.finish)
    until_waiting(1, "COMMIT")
    two = InThread(second.finish)
    until_waiting(2)
    holder.finish()
    one.join()
    two.join()
    assert (one.result, two.result) == (None, None)


def test_a_replay_of_a_member_and_an_add_waiting_for_it_both_go_through():
    batch = queue_batches.open(None)
    [member] = queue_batches.add(batch, [NewJob(name=UP)])
    [held] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants())
    assert queue.fail(held, code="rejected")
    producer = Producer(
        lambda: queue_batches.add(batch, [NewJob(name=DOWN, after=(member.id,))])
    ).start()
    replay = InThread(lambda: queue.replay([member.id], by="operator"))
    until_waiting()
    assert producer.finish() is None
    replay.join()
    assert replay.error is None and replay.result.replayed == (member.id,)


class Noop(Payload, name="test.lock_order.noop.v1"):
    pass


def enqueue(name: str = UP, **fields) -> int:
    """Enqueue one job; its dependency checks run as its commit would run them."""
    id_ = queue.enqueue(NewJob(name=name, **fields)).id
    settle()
    return id_


def claim(name: str = UP, count: int = 100):
    return queue.claim([ClaimRequest(name, count)], scope=AllTenants())


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
        wait_for(then_when, what="the second session waits for a lock", interval=0.01)
        release.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a test thread did not finish in time"
    return errors


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


@pytest.mark.django_db(transaction=True)
def test_a_deadlocked_outcome_is_written_as_it_was_not_turned_into_a_failure(monkeypatch):
    # A transaction that added to a batch holds its row to the commit; waiting for a sibling
    # afterwards deadlocks with the sibling's outcome. Whichever PostgreSQL aborts, the
    # outcome ends written as the handler's, not as a failure. The outcome's lock wait is
    # made long, so it still waits for the batch row when the adder is let go, however slowly
    # this test sees the wait on a busy machine (the worker's own wait is a moment).
    from jobs.worker import completer
    from jobs.worker.completer import write_one_by_one

    monkeypatch.setattr(completer, "LOCK_WAIT", 30.0)

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
