"""Sessions that end jobs, add to batches and enqueue ``after=`` take their locks in one order.

An add to a batch holds the batch's row and, as it commits, locks the jobs its members wait
for; whatever ends or brings back a batch member locks the batch's row before the member's;
the deferred checks of one transaction lock the jobs waited for in id order. No two of these
can deadlock, so no producer's COMMIT and no operator's action fails with one.
"""

from __future__ import annotations

import pytest

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob
from jobs.queue import batches as queue_batches
from tests.support.concurrency import InThread, Producer, until_waiting

UP, DOWN = "test.noop.v1", "test.after.v1"

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
