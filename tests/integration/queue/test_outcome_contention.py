"""An outcome that meets a row lock is deferred, never turned into a failure or a second run.

Writing a job's outcome also moves its batch's counts (the settle trigger), and documented
calls hold locks until their transaction commits: adding members to an open batch, enqueue
with ``after=``, and ``jobs.complete(ctx)`` inside a member's transaction. Each test holds
such a transaction open well past ``DB_LOCK_TIMEOUT`` while a real worker finishes a job
the lock stands in front of: the handler runs once, the job ends ``succeeded`` once the lock
is gone, and the worker's other jobs are not held up meanwhile.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connections, transaction
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jobs
from jobs import JobContext, Payload
from jobs import queue as jobs_queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job, JobHistory
from jobs.queue import NewJob
from jobs.queue import batches as queue_batches
from tests.support.polling import wait_for
from tests.support.worker import Echo, Recorder, echo_handler, running_worker

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: Short enough to pass several times while a test holds its transaction open.
LOCK_TIMEOUT = 0.3
#: How long each test holds its lock: well past the lock timeout.
HOLD = 1.5

FAST_LOCKS = override_settings(JOBS={"DB_LOCK_TIMEOUT": LOCK_TIMEOUT, "DB_STATEMENT_TIMEOUT": 5})


class Contended(Payload, name="test.contended.v1"):
    """A job the tests finish while another session holds a lock in its way."""

    label: str = ""


class Holder:
    """Runs ``work`` in a transaction on a thread of its own and keeps it open until told."""

    def __init__(self, work) -> None:
        self.work = work
        self.entered = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Holder:
        self.thread.start()
        assert self.entered.wait(10), "the holding transaction did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc_info) -> None:
        self.release.set()
        self.thread.join(20)
        assert not self.thread.is_alive()
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def _run(self) -> None:
        try:
            with transaction.atomic():
                self.result = self.work()
                self.entered.set()
                self.release.wait(30)
        except BaseException as exc:  # reported to the test
            self.error = exc
            self.entered.set()
        finally:
            connections.close_all()


def state_of(pk: int) -> str:
    row = Job.objects.filter(pk=pk).values_list("state", flat=True).first()
    if row is None:
        row = JobHistory.objects.filter(pk=pk).values_list("state", flat=True).first()
    return row


def contended_registry(recorder: Recorder, handler=None) -> Registry:
    def handle(payload: Contended, ctx: JobContext):
        recorder.enter(payload, ctx)
        try:
            if handler is not None:
                return handler(payload, ctx)
            return {"label": payload.label}
        finally:
            recorder.leave(ctx)

    return Registry(
        [
            JobType(Contended, handle, Policy(concurrency=4, max_attempts=3)),
            JobType(Echo, echo_handler(recorder), Policy(concurrency=4)),
        ]
    )


def runs_of(recorder: Recorder, label: str) -> int:
    with recorder.lock:
        return sum(1 for payload, _ in recorder.calls if getattr(payload, "label", "") == label)


def assert_held_then_succeeded(pk: int, holder: Holder, recorder: Recorder, label: str) -> None:
    """While ``holder`` keeps its lock, ``pk`` ran once and is not failed; after, it succeeds."""
    wait_for(lambda: runs_of(recorder, label) == 1, what="the handler ran", interval=0.005)
    deadline = time.monotonic() + HOLD
    while time.monotonic() < deadline:
        assert state_of(pk) not in ("failed", "cancelled"), "contention became a verdict"
        time.sleep(0.02)
    # Another job of the same worker is not held up by the deferred outcome.
    other = jobs.enqueue(Echo(text="meanwhile"))
    wait_for(
        lambda: state_of(other.id) == "succeeded",
        timeout=LOCK_TIMEOUT * 3,
        what="another job finished while the outcome waited",
        interval=0.005,
    )
    holder.release.set()
    wait_for(
        lambda: state_of(pk) == "succeeded", what="the deferred outcome was written", interval=0.005
    )
    assert runs_of(recorder, label) == 1
    assert Job.objects.filter(pk=pk).values_list("attempts", flat=True).first() in (1, None)


@FAST_LOCKS
def test_a_member_finishing_while_members_are_added_to_its_batch_succeeds_once():
    recorder = Recorder()
    batch_id = queue_batches.open(None)
    started = threading.Event()
    go = threading.Event()

    def handler(payload, ctx):
        started.set()
        go.wait(10)
        return None

    with running_worker(contended_registry(recorder, handler)):
        [member] = queue_batches.add(
            batch_id, [NewJob(name=Contended.job_name, payload={"label": "member"})]
        )
        assert started.wait(10)
        more = [
            NewJob(name=Echo.job_name, payload={"text": f"m{i}"}, queue="later") for i in range(3)
        ]
        with Holder(lambda: queue_batches.add(batch_id, more)) as holder:
            go.set()
            assert_held_then_succeeded(member.id, holder, recorder, "member")


@FAST_LOCKS
def test_a_job_finishing_while_a_producer_waits_after_its_dependent_succeeds_once():
    recorder = Recorder()
    started = threading.Event()
    go = threading.Event()

    def handler(payload, ctx):
        if payload.label == "upstream":
            started.set()
            go.wait(10)
        return None

    with running_worker(contended_registry(recorder, handler)):
        upstream = jobs.enqueue(Contended(label="upstream"))
        assert started.wait(10)
        waiting = jobs.enqueue(Contended(label="waiting"), after=[upstream])
        # A producer adds a job after the one that waits: its transaction stays open.
        with Holder(lambda: jobs.enqueue(Contended(label="third"), after=[waiting])) as holder:
            go.set()
            assert_held_then_succeeded(upstream.id, holder, recorder, "upstream")
        wait_for(
            lambda: state_of(waiting.id) == "succeeded", what="the waiting job ran", interval=0.005
        )


@FAST_LOCKS
def test_a_member_finishing_while_a_sibling_completes_in_its_own_transaction_succeeds_once():
    recorder = Recorder()
    batch_id = queue_batches.open(None)
    inside = threading.Event()
    leave = threading.Event()

    def handler(payload, ctx):
        if payload.label == "completer":
            with transaction.atomic(using=ctx.using):
                jobs.complete(ctx)
                inside.set()
                leave.wait(10)  # the sibling's outcome comes while this holds the batch
        else:
            inside.wait(10)
        return None

    class Leaver:
        """What the shared assertion releases: the completer's transaction."""

        release = leave

    with running_worker(contended_registry(recorder, handler)):
        [_, sibling] = queue_batches.add(
            batch_id,
            [
                NewJob(name=Contended.job_name, payload={"label": "completer"}),
                NewJob(name=Contended.job_name, payload={"label": "sibling"}),
            ],
        )
        assert inside.wait(10)
        assert_held_then_succeeded(sibling.id, Leaver, recorder, "sibling")
    assert queue_batches.get(batch_id).succeeded == 2


@FAST_LOCKS
def test_a_producer_holding_its_transaction_past_a_lease_does_not_disturb_the_running_job():
    """Enqueue ``after=`` a running job never costs it its lease (so never a second run)."""
    recorder = Recorder()
    started = threading.Event()
    go = threading.Event()

    def handler(payload, ctx):
        if payload.label == "upstream":
            started.set()
            go.wait(10)
        return None

    lease = timedelta(seconds=1)
    with running_worker(contended_registry(recorder, handler), lease=lease, recovery_interval=0.1):
        upstream = jobs.enqueue(Contended(label="upstream"))
        assert started.wait(10)
        with Holder(lambda: jobs.enqueue(Contended(label="after"), after=[upstream])) as holder:
            # Past two leases: a lease the renewal could not extend is taken back by now.
            deadline = time.monotonic() + 2.5 * lease.total_seconds()
            while time.monotonic() < deadline:
                assert runs_of(recorder, "upstream") == 1, "the running job ran a second time"
                time.sleep(0.05)
            holder.release.set()
        go.set()
        wait_for(
            lambda: state_of(upstream.id) == "succeeded",
            what="the upstream finished",
            interval=0.005,
        )
        wait_for(
            lambda: state_of(holder.result.id) == "succeeded",
            what="its dependent ran",
            interval=0.005,
        )
    assert runs_of(recorder, "upstream") == 1


# Locks another session may hold while a job's outcome is written: on the job's own row, its
# batch's row, a job waiting for it and that job's edge (row locks of every strength), and
# the tables its settle trigger writes (table locks that stop their writes).
ROW_TARGETS = {
    "the job": "SELECT 1 FROM jobs_job WHERE id = %(job)s FOR {mode}",
    "its batch": "SELECT 1 FROM jobs_batch WHERE id = %(batch)s FOR {mode}",
    "a job waiting for it": "SELECT 1 FROM jobs_job WHERE id = %(waiting)s FOR {mode}",
    "the waiting job's edge": "SELECT 1 FROM jobs_dependency WHERE job = %(waiting)s FOR {mode}",
}
ROW_MODES = ("UPDATE", "NO KEY UPDATE", "SHARE", "KEY SHARE")
TABLE_TARGETS = ("jobs_batch", "jobs_settlement", "jobs_dependency")
TABLE_MODES = ("SHARE", "SHARE ROW EXCLUSIVE", "EXCLUSIVE")

locks = st.one_of(
    st.tuples(st.sampled_from(sorted(ROW_TARGETS)), st.sampled_from(ROW_MODES)).map(
        lambda pick: ROW_TARGETS[pick[0]].format(mode=pick[1])
    ),
    st.tuples(st.sampled_from(TABLE_TARGETS), st.sampled_from(TABLE_MODES)).map(
        lambda pick: f"LOCK TABLE {pick[0]} IN {pick[1]} MODE"
    ),
)


@FAST_LOCKS
def test_any_lock_held_past_the_lock_timeout_defers_the_outcome_it_never_decides_it():
    """Whatever lock another session holds, the handler runs once and the job ends as its
    handler said (succeeded, or failed as rejected), never as the database's refusal."""
    recorder = Recorder()
    go: dict[str, threading.Event] = {}

    def handler(payload, ctx):
        go[payload.label].wait(10)
        if payload.label.startswith("reject"):
            raise jobs.Reject("no")
        return None

    with running_worker(contended_registry(recorder, handler)):

        @settings(
            max_examples=12,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(lock=locks, rejected=st.booleans())
        def check(lock: str, rejected: bool) -> None:
            label = f"{'reject' if rejected else 'ok'}-{len(go)}"
            go[label] = threading.Event()
            batch = queue_batches.open(None)
            [member] = queue_batches.add(
                batch, [NewJob(name=Contended.job_name, payload={"label": label})]
            )
            # A type no worker serves: it stays waiting, its row and edge there to lock.
            waiting = jobs_queue.enqueue(NewJob(name="test.unserved.v1", after=(member.id,)))
            wait_for(
                lambda: runs_of(recorder, label) == 1, what="the handler started", interval=0.005
            )

            def hold():
                with connections["default"].cursor() as cur:
                    cur.execute(lock, {"job": member.id, "batch": batch, "waiting": waiting.id})

            with Holder(hold) as holder:
                go[label].set()
                deadline = time.monotonic() + HOLD
                while time.monotonic() < deadline:
                    row = Job.objects.filter(pk=member.id).values("state", "last_error").first()
                    assert row is None or row["last_error"] != "handler_error", row
                    time.sleep(0.05)
                holder.release.set()
            expected = ("failed", "rejected") if rejected else ("succeeded", "")
            wait_for(
                lambda: (
                    Job.objects.filter(pk=member.id, state=expected[0]).exists()
                    or JobHistory.objects.filter(pk=member.id, state=expected[0]).exists()
                ),
                what=f"the job ended {expected[0]} after {lock}",
                interval=0.005,
            )
            assert runs_of(recorder, label) == 1

        check()


@FAST_LOCKS
@pytest.mark.parametrize("poll", [0.05, 0.5])
def test_a_member_whose_batch_row_is_held_past_two_leases_keeps_its_lease_and_runs_once(poll):
    """The member's outcome is written alone while the batch row stays held: the write waits
    for the batch row before it locks the member's own, which the lease renewal must reach."""
    recorder = Recorder()
    batch_id = queue_batches.open(None)
    lease = timedelta(seconds=1)
    registry = contended_registry(recorder)
    with running_worker(registry, lease=lease, recovery_interval=0.1, poll_interval=poll):
        [member] = queue_batches.add(
            batch_id, [NewJob(name=Contended.job_name, payload={"label": "member"})]
        )
        more = [NewJob(name=Echo.job_name, payload={"text": "m"}, queue="later")]
        with Holder(lambda: queue_batches.add(batch_id, more)) as holder:
            wait_for(
                lambda: runs_of(recorder, "member") == 1, what="the member ran", interval=0.005
            )
            deadline = time.monotonic() + 3.5 * lease.total_seconds()
            while time.monotonic() < deadline:
                assert runs_of(recorder, "member") == 1, "the member ran a second time"
                assert state_of(member.id) not in ("failed", "cancelled")
                time.sleep(0.05)
            holder.release.set()
        wait_for(
            lambda: state_of(member.id) == "succeeded", what="the member succeeded", interval=0.005
        )
    assert runs_of(recorder, "member") == 1
