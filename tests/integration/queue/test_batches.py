"""Batches: the successor is enqueued once, when every member is terminal, whatever the mix."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import Batch, Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob
from jobs.queue import batches as queue_batches
from jobs.queue.batches import BatchClosed, BatchNotFound
from jobs.queue.types import InvalidJob
from tests.support.workflows import settle

NAME = "test.noop.v1"
UP, DOWN, REPORT = "test.noop.v1", "test.after.v1", "test.report.v1"
SUCCESSOR = NewJob(name="test.report.v1", payload={"report": True})


def open_batch(successor: NewJob | None = SUCCESSOR, **kwargs) -> int:
    return queue_batches.open(successor, **kwargs)


def add(batch_id: int, count: int, **fields) -> list[int]:
    jobs = [NewJob(name=NAME, payload={"i": i}, **fields) for i in range(count)]
    return [result.id for result in queue_batches.add(batch_id, jobs)]


def claim(count: int = 100):
    return queue.claim([ClaimRequest(NAME, count)], scope=AllTenants())


def successors() -> list[Job]:
    return list(Job.objects.filter(name=SUCCESSOR.name))


def counts(batch_id: int) -> tuple[int, int, int, int]:
    state = queue_batches.get(batch_id)
    return state.total, state.succeeded, state.failed, state.cancelled


@pytest.mark.django_db
def test_successor_enqueued_once_when_every_member_is_terminal_whatever_the_mix():
    batch_id = open_batch()
    add(batch_id, 4)
    queue_batches.seal(batch_id)
    first, second, third, fourth = claim()
    queue.complete(first)
    queue.fail(second, code="rejected", detail="bad row")
    queue.cancel([fourth.id], by="test")  # running: asked to stop, nothing counted yet
    assert successors() == []
    queue.complete(third)
    assert successors() == []  # the fourth is still running
    queue.record([queue.Outcome.cancelled(fourth)])  # the worker stopped it at renewal

    [successor] = successors()
    state = queue_batches.get(batch_id)
    assert state.finished == state.total == 4
    assert (state.succeeded, state.failed, state.cancelled) == (2, 1, 1)
    assert state.successor_pk == successor.id and state.fired_at is not None
    assert (successor.payload, successor.state) == ({"report": True}, "queued")
    assert queue_batches.of_successor(successor.id) == batch_id


@pytest.mark.django_db
def test_a_retry_is_not_terminal_and_does_not_count():
    batch_id = open_batch()
    add(batch_id, 1)
    queue_batches.seal(batch_id)
    [job] = claim()
    queue.retry(job, code="handler_error", delay=0)
    assert counts(batch_id) == (1, 0, 0, 0) and successors() == []
    [again] = claim()
    queue.complete(again)
    assert counts(batch_id) == (1, 1, 0, 0) and len(successors()) == 1


@pytest.mark.django_db
def test_an_unsealed_batch_waits_for_its_seal_and_an_empty_one_fires_at_seal():
    batch_id = open_batch()
    add(batch_id, 2)
    for job in claim():
        queue.complete(job)
    assert counts(batch_id) == (2, 2, 0, 0) and successors() == []
    assert queue_batches.seal(batch_id) is True
    assert len(successors()) == 1
    assert queue_batches.seal(batch_id) is False  # sealing twice fires nothing more
    assert len(successors()) == 1

    empty = open_batch(NewJob(name="test.report.v1", payload={"empty": True}))
    assert queue_batches.seal(empty) is True
    assert Job.objects.filter(payload={"empty": True}).count() == 1


@pytest.mark.django_db
def test_cancelled_queued_members_count_as_finished():
    batch_id = open_batch()
    ids = add(batch_id, 3)
    queue_batches.seal(batch_id)
    queue.cancel(ids, by="operator")
    assert counts(batch_id) == (3, 0, 0, 3)
    assert len(successors()) == 1
    assert [f.id for f in queue_batches.failures(batch_id)] == ids


@pytest.mark.django_db
def test_members_added_after_the_seal_hold_the_batch_open_until_it_fires():
    batch_id = open_batch()
    add(batch_id, 1)
    queue_batches.seal(batch_id)
    [job] = claim()
    # A running member adds a member to its own batch before it finishes.
    add(batch_id, 1)
    queue.complete(job)
    assert successors() == []
    [child] = claim()
    queue.complete(child)
    assert counts(batch_id) == (2, 2, 0, 0) and len(successors()) == 1
    with pytest.raises(BatchClosed, match="has finished"):
        add(batch_id, 1)
    assert counts(batch_id) == (2, 2, 0, 0)  # the refused add left nothing behind
    with pytest.raises(BatchNotFound):
        add(batch_id + 1000, 1)


@pytest.mark.django_db
def test_a_member_whose_key_is_taken_is_returned_not_counted():
    batch_id = open_batch(None)
    queue.enqueue(NewJob(name=NAME, job_id="taken"))
    [result] = queue_batches.add(batch_id, [NewJob(name=NAME, job_id="taken")])
    assert not result.created
    assert counts(batch_id) == (0, 0, 0, 0)
    assert Job.objects.get(pk=result.id).batch_id is None


@pytest.mark.django_db
def test_replaying_a_failed_member_after_the_successor_fired_moves_the_counts_only():
    batch_id = open_batch()
    add(batch_id, 2)
    queue_batches.seal(batch_id)
    good, bad = claim()
    queue.complete(good)
    queue.fail(bad, code="rejected")
    assert counts(batch_id) == (2, 1, 1, 0) and len(successors()) == 1

    queue.replay([bad.id], by="operator")
    assert counts(batch_id) == (2, 1, 0, 0)  # out of the counts until it finishes again
    [again] = claim()
    queue.complete(again)
    assert counts(batch_id) == (2, 2, 0, 0)
    assert len(successors()) == 1  # the successor ran once; it does not run again


@pytest.mark.django_db
def test_failures_are_listed_from_the_history_after_the_archive_pass():
    batch_id = open_batch(None)
    add(batch_id, 2)
    queue_batches.seal(batch_id)
    for job in claim():
        queue.fail(job, code="rejected", detail=f"row {job.payload['i']}")
    Job.objects.filter(batch_id=batch_id).update(key_held=False)
    queue.history.archive(now=timezone.now() + timedelta(days=1))
    assert not Job.objects.filter(batch_id=batch_id).exists()
    assert sorted(f.error_detail for f in queue_batches.failures(batch_id)) == ["row 0", "row 1"]
    assert counts(batch_id) == (2, 0, 2, 0)


@pytest.mark.django_db
def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(InvalidJob, match="takes no after"):
        queue_batches.open(NewJob(name="x.v1", after=(1,)))
    with pytest.raises(InvalidJob, match="description"):
        queue_batches.open(None, description="x" * 201)
    with pytest.raises(InvalidJob, match="tenant"):
        queue_batches.open(None, tenant="not a tenant")
    assert not Batch.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_members_finishing_at_the_same_instant_fire_the_successor_exactly_once(threads):
    batch_id = open_batch()
    add(batch_id, 24)
    queue_batches.seal(batch_id)
    held = claim()
    assert len(held) == 24

    def finish(index: int) -> bool:
        job = held[index]
        if index % 3 == 0:
            return queue.fail(job, code="rejected")
        return queue.complete(job)

    assert all(threads(24, finish))
    assert counts(batch_id) == (24, 16, 8, 0)
    assert len(successors()) == 1


@pytest.mark.django_db(transaction=True)
def test_a_batch_outcome_statement_of_many_members_fires_once():
    """The worker writes many outcomes in one statement: the trigger runs per member."""
    batch_id = open_batch()
    add(batch_id, 50)
    queue_batches.seal(batch_id)
    held = claim()
    report = queue.record([queue.Outcome.succeeded(job, None) for job in held])
    assert len(report.applied) == 50
    assert counts(batch_id) == (50, 50, 0, 0) and len(successors()) == 1


@pytest.mark.django_db
def test_the_successor_transaction_is_the_members_transaction():
    """A rolled-back outcome rolls back the counts and the successor with it."""
    batch_id = open_batch()
    add(batch_id, 1)
    queue_batches.seal(batch_id)
    [job] = claim()
    with pytest.raises(RuntimeError), transaction.atomic():
        queue.complete(job)
        assert len(successors()) == 1
        raise RuntimeError("rolled back")
    assert counts(batch_id) == (1, 0, 0, 0) and successors() == []
    assert queue.complete(job)
    assert len(successors()) == 1


# Any sequence of member outcomes, operator cancels and replays keeps the counts equal to the
# members' states, and fires the successor at most once, exactly when a sealed batch's
# members are all terminal.
_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["claim", "complete", "fail", "retry", "cancel", "replay", "add"]),
        st.integers(0, 5),
    ),
    max_size=25,
)


@pytest.mark.django_db
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=_ACTIONS, initial=st.integers(0, 4), seal_at=st.integers(0, 25))
def test_counts_follow_member_states_under_any_sequence(actions, initial, seal_at):
    with transaction.atomic():
        sid = transaction.savepoint()
        try:
            _run_sequence(actions, initial, seal_at)
        finally:
            transaction.savepoint_rollback(sid)


def _run_sequence(actions, initial, seal_at):
    batch_id = open_batch()
    add(batch_id, initial)
    held = {}
    fired_while_open = False
    for step, (action, pick) in enumerate(actions):
        if step == seal_at:
            queue_batches.seal(batch_id)
        members = list(Job.objects.filter(batch_id=batch_id).order_by("id"))
        target = members[pick % len(members)] if members else None
        if action == "add":
            try:
                add(batch_id, 1)
            except BatchClosed:
                assert queue_batches.get(batch_id).fired_at is not None
        elif action == "claim":
            for job in claim(1):
                held[job.id] = job
        elif target is not None and target.id in held and target.state == "running":
            job = held.pop(target.id)
            if action in ("complete", "replay"):
                queue.complete(job)
            elif action == "fail":
                queue.fail(job, code="rejected")
            elif action == "retry":
                queue.retry(job, code="handler_error")
            else:
                queue.record([queue.Outcome.cancelled(job)])
        elif target is not None and action == "cancel":
            queue.cancel([target.id], by="t")
        elif target is not None and action == "replay":
            queue.replay([target.id], by="t")
        state = queue_batches.get(batch_id)
        members = list(Job.objects.filter(batch_id=batch_id))
        by_state = {
            s: sum(m.state == s for m in members) for s in ("succeeded", "failed", "cancelled")
        }
        assert (state.total, state.succeeded, state.failed, state.cancelled) == (
            len(members),
            by_state["succeeded"],
            by_state["failed"],
            by_state["cancelled"],
        )
        fired = len(successors())
        assert fired <= 1
        if state.sealed_at is not None and state.finished == state.total:
            assert fired == 1
        if state.sealed_at is None:
            fired_while_open = fired_while_open or fired > 0
    assert not fired_while_open
    with connection.cursor() as cur:
        cur.execute("SELECT 1")  # the connection is still usable: no statement left it broken


@pytest.mark.django_db
def test_retention_deletes_finished_batches_and_forgotten_open_ones_only():
    finished = open_batch(None)
    queue_batches.seal(finished)  # empty: fires at once
    open_batch(None)  # never sealed, no member: forgotten
    busy = open_batch(None)
    add(busy, 1)  # never sealed, a member still queued
    later = timezone.now() + timedelta(days=15)

    assert queue_batches.prune(older_than=timedelta(days=14)) == 0
    assert queue_batches.prune(older_than=timedelta(days=14), now=later) == 2
    assert set(Batch.objects.values_list("id", flat=True)) == {busy}
    with pytest.raises(BatchNotFound):
        queue_batches.get(finished)


def enqueue(name: str = UP, **fields) -> int:
    """Enqueue one job; its dependency checks run as its commit would run them."""
    id_ = queue.enqueue(NewJob(name=name, **fields)).id
    settle()
    return id_


def claim_of(name: str = UP, count: int = 100):
    return queue.claim([ClaimRequest(name, count)], scope=AllTenants())


@pytest.mark.django_db
def test_a_successor_whose_key_holder_has_expired_is_enqueued_afresh():
    old = enqueue(REPORT, job_id="nightly-report")
    [job] = claim_of(REPORT)
    assert queue.complete(job)
    Job.objects.filter(pk=old).update(finished_at=timezone.now() - timedelta(days=30))
    # enqueue() would let the expired holder go and insert a new job under the key.
    batch_id = queue_batches.open(NewJob(name=REPORT, job_id="nightly-report"))
    queue_batches.add(batch_id, [NewJob(name=UP)])
    queue_batches.seal(batch_id)
    [member] = claim_of()
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
    good, bad = claim_of()
    queue.complete(good)
    queue.fail(bad, code="rejected")
    fired = queue_batches.get(batch_id)
    assert queue.replay([bad.id], by="operator").replayed == (bad.id,)
    state = queue_batches.get(batch_id)
    assert (state.finished, state.failed) == (1, 0)
    [successor] = claim_of(REPORT)
    assert successor.id == fired.successor_pk
    [again] = claim_of()
    queue.complete(again)
    after = queue_batches.get(batch_id)
    assert (after.succeeded, after.failed, after.successor_pk) == (2, 0, fired.successor_pk)
    assert Job.objects.filter(name=REPORT).count() == 1


@pytest.mark.django_db
def test_a_failed_member_replayed_from_the_history_is_counted_again_before_the_fire():
    batch_id = queue_batches.open(NewJob(name=REPORT))
    [member] = queue_batches.add(batch_id, [NewJob(name=UP)])
    [job] = claim_of()
    queue.fail(job, code="rejected")
    Job.objects.filter(pk=member.id).update(key_held=False)
    queue.history.archive(now=timezone.now() + timedelta(days=1))
    assert JobHistory.objects.filter(pk=member.id).exists()
    assert queue_batches.get(batch_id).failed == 1

    assert queue.replay([member.id], by="operator").replayed == (member.id,)
    assert queue_batches.get(batch_id).failed == 0
    assert queue_batches.seal(batch_id) is False  # the replayed member holds it open
    [again] = claim_of()
    assert queue.complete(again)
    state = queue_batches.get(batch_id)
    assert (state.succeeded, state.failed) == (1, 0) and state.fired_at is not None
    assert Job.objects.filter(name=REPORT).count() == 1


@pytest.mark.django_db
def test_a_member_waiting_for_a_failed_job_settles_a_sealed_batch_inside_add():
    up = enqueue()
    [job] = claim_of()
    queue.fail(job, code="rejected")
    batch_id = queue_batches.open(NewJob(name=REPORT))
    queue_batches.seal(batch_id)  # empty: fired already
    late = queue_batches.open(NewJob(name=REPORT, payload={"late": True}))
    [member] = queue_batches.add(late, [NewJob(name=DOWN, after=(up,))])
    assert Job.objects.get(pk=member.id).state == "cancelled"
    assert queue_batches.seal(late) is True
    assert queue_batches.get(late).cancelled == 1
