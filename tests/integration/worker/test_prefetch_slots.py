"""A prefetched job starts only into a free slot: parked, resumed, drained, cancelled.

With ``--prefetch`` a worker holds claimed jobs beyond its ``concurrency`` slots. A held job
of either kind counts as started only while fewer than ``concurrency`` handlers run
(``Worker._slot_taken``); otherwise it is parked in ``Worker._waiting`` until a handler ends,
and ``Worker._finished`` resumes the first parked job (``_resume``), the freed slot counted
for it as it is popped.

Checked here: sync and async handlers together never exceed ``concurrency`` for any mix of
jobs and endings (BaseExceptions, an async handler cancelling itself), every job runs exactly
once and the worker's books return to zero; a thread-only worker never parks a job (the gate
is one comparison on its path); a resumed job takes the slot that was freed for it; a parked
job's timeout runs from its start, not its claim; parked jobs keep their leases, go back at
once on a drain (also with a lost one among them); a drain at any moment leaves each job run
once or handed back untried, never both, and one that lands as a parked job is resumed does
not wait for a lost one; a forced stop with a handler that ignores its cancellation hands
them back too; a parked job whose lease is lost never runs, leaves its run row alone, and its
fresh claim runs once; an operator's cancel ends a parked job before its handler.

Every test runs a real ``Worker`` on PostgreSQL in a thread of this process; waits poll with
deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import JobContext, JobSpec, Payload, RetryAfter, enqueue, enqueue_many
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.queue.maintenance import requeue_expired
from jobs.queue.operations import cancel, cancel_running
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.runapp.models import Delivery
from tests.support.polling import wait_for
from tests.support.worker import Unruly

pytestmark = pytest.mark.django_db(transaction=True)

TERMINAL = ("succeeded", "failed", "cancelled")


# -- job types ------------------------------------------------------------------------------------


class Work(Payload, name="test.prefetch.work.v1"):
    """A sync job: ``action`` says what its handler does, ``seconds`` how long it waits."""

    action: str = "ok"
    seconds: float = 0.0


class AWork(Payload, name="test.prefetch.awork.v1"):
    """The same for an ``async def`` handler."""

    action: str = "ok"
    seconds: float = 0.0


class Timed(Payload, name="test.prefetch.timed.v1"):
    """A sync job of a type with a short timeout (``SHORT_TIMEOUT``)."""

    action: str = "ok"
    seconds: float = 0.0


class ATimed(Payload, name="test.prefetch.atimed.v1"):
    action: str = "ok"
    seconds: float = 0.0


class Bound(Payload, name="test.prefetch.bound.v1"):
    """A sync job bound to a run row (tests.runapp Delivery)."""

    run_id: int
    action: str = "ok"
    seconds: float = 0.0


class ABound(Payload, name="test.prefetch.abound.v1"):
    run_id: int
    action: str = "ok"
    seconds: float = 0.0


SHORT_TIMEOUT = 0.4


class Slots:
    """Which handlers were entered (by job row id, with their claim tokens) and how many ran
    at once, sync and async together."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered: Counter[int] = Counter()
        self.tokens: dict[int, list[object]] = {}
        self.active = 0
        self.peak = 0

    def enter(self, ctx: JobContext) -> None:
        with self.lock:
            self.entered[ctx.id] += 1
            self.tokens.setdefault(ctx.id, []).append(ctx.claim_token)
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def reset(self) -> None:
        with self.lock:
            self.entered.clear()
            self.tokens.clear()
            self.peak = self.active


def sync_handler(slots: Slots):
    def handle(payload, ctx: JobContext):
        slots.enter(ctx)
        try:
            action = payload.action
            if action == "retry-once" and ctx.attempt == 1:  # waited out in the slot
                raise RetryAfter(0.01)
            if action == "sleep":
                time.sleep(payload.seconds)
            elif action == "system-exit":
                raise SystemExit(3)
            elif action == "keyboard-interrupt":
                raise KeyboardInterrupt
            elif action == "unruly":
                raise Unruly("not an Exception")
            elif action == "cancelled-error":
                raise asyncio.CancelledError
            return {"ok": True}
        finally:
            slots.leave()

    return handle


def async_handler(slots: Slots):
    async def handle(payload, ctx: JobContext):
        slots.enter(ctx)
        try:
            action = payload.action
            if action == "retry-once" and ctx.attempt == 1:  # waited out in the slot
                raise RetryAfter(0.01)
            if action == "sleep":
                await asyncio.sleep(payload.seconds)
            elif action == "ignore-cancel":  # swallows every cancellation until its time is up
                end = time.monotonic() + payload.seconds
                while (left := end - time.monotonic()) > 0:
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(left)
            elif action == "system-exit":
                raise SystemExit(3)
            elif action == "keyboard-interrupt":
                raise KeyboardInterrupt
            elif action == "unruly":
                raise Unruly("not an Exception")
            elif action == "cancelled-error":
                raise asyncio.CancelledError
            elif action == "self-cancel":  # the handler's own task cancelled under it
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(1)
            return {"ok": True}
        finally:
            slots.leave()

    return handle


def mixed(slots: Slots) -> Registry:
    """Both kinds, a short-timeout type of each, and a run-bound type of each."""
    sync, asynchronous = sync_handler(slots), async_handler(slots)
    long = Policy(timeout=timedelta(seconds=60))
    short = Policy(timeout=timedelta(seconds=SHORT_TIMEOUT))
    bound = Policy(timeout=timedelta(seconds=60), run_model=Delivery)
    return Registry(
        [
            JobType(Work, sync, long),
            JobType(AWork, asynchronous, long),
            JobType(Timed, sync, short),
            JobType(ATimed, asynchronous, short),
            JobType(Bound, sync, bound),
            JobType(ABound, asynchronous, bound),
        ]
    )


class CountingDeque(deque):
    """``Worker._waiting`` that counts the jobs parked in it, and how often each was."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = 0
        self.times: Counter[int] = Counter()  # by job row id

    def append(self, item) -> None:
        self.parked += 1
        self.times[item.job.id] += 1
        super().append(item)


# -- worker plumbing ------------------------------------------------------------------------------


def start(registry: Registry, **config) -> tuple[Worker, threading.Thread]:
    options = {"install_signal_handlers": False, "poll_interval": 0.05, **config}
    worker = Worker(registry, WorkerConfig(**options))
    worker.slots.waiting = CountingDeque()
    thread = threading.Thread(target=worker.run, name="prefetch-worker")
    thread.start()
    return worker, thread


def stop(worker: Worker, thread: threading.Thread, timeout: float = 20) -> None:
    worker.request_stop()
    thread.join(timeout)
    assert not thread.is_alive(), "the worker did not stop"


def held_by(worker: Worker) -> int:
    return Job.objects.filter(state="running", claimed_by=worker.config.identity).count()


def state_of(job) -> Job:
    return Job.objects.get(pk=job.id)


def ended(jobs) -> bool:
    ids = [j.id for j in jobs]
    return Job.objects.filter(pk__in=ids, state__in=TERMINAL).count() == len(ids)


def warm_up(slots: Slots) -> None:
    """A no-op job of each kind: the worker's handlers measure short, so it prefetches."""
    jobs = [enqueue(Work()), enqueue(AWork()), enqueue(Work()), enqueue(AWork())]
    wait_for(lambda: ended(jobs), what="the warm-up jobs ran", interval=0.005)


def held(worker: Worker, job) -> list:
    """The worker's attempts of ``job`` (its Running objects)."""
    with worker.slots.lock:
        return [r for r in worker.slots.held.values() if r.job.id == job.id]


def books_closed(worker: Worker) -> bool:
    with worker.slots.lock:
        return (
            worker.slots.in_flight == 0
            and worker.handlers_running == 0
            and not worker.slots.held
            and not worker.completer.acks
            and not any(not r.handed_back for r in worker.slots.waiting)
        )


def hold_the_slot(slots: Slots, payload: Payload) -> object:
    """Enqueue ``payload`` (a long job) and wait until its handler runs."""
    long = enqueue(payload)
    wait_for(lambda: slots.entered[long.id] == 1, what="the long job started", interval=0.005)
    return long


def expire_and_requeue(job, *, run_after=None) -> None:
    """Take the job away from its worker, as a stall and another worker's recovery would:
    its lease ends and the recovery requeues it (new claims get a new token). The row is
    locked from the first update on, so the worker's renewal skips it meanwhile."""
    with transaction.atomic():
        Job.objects.filter(pk=job.id).update(lease_expires_at=timezone.now() - timedelta(hours=1))
        swept = requeue_expired()
        assert [row.id for row in swept] == [job.id]
        if run_after is not None:
            Job.objects.filter(pk=job.id).update(run_after=run_after)


# -- any mix of jobs ------------------------------------------------------------------------------

SYNC_ACTIONS = [
    "ok",
    "sleep",
    "retry-once",
    "system-exit",
    "keyboard-interrupt",
    "unruly",
    "cancelled-error",
]
ASYNC_ACTIONS = [*SYNC_ACTIONS, "self-cancel"]

JOBS = st.one_of(
    st.tuples(st.just("sync"), st.sampled_from(SYNC_ACTIONS), st.sampled_from([0.0, 0.005, 0.02])),
    st.tuples(
        st.just("async"), st.sampled_from(ASYNC_ACTIONS), st.sampled_from([0.0, 0.005, 0.02])
    ),
)
HEAVY = [("async", "sleep", 0.02)] * 4 + [("sync", "sleep", 0.02)] * 4


@pytest.mark.parametrize("concurrency", [1, 3])
def test_any_mix_of_jobs_runs_each_once_within_the_slots_and_closes_the_books(concurrency):
    """Sync and async handlers together never exceed ``concurrency``, whatever the jobs do
    (return, raise SystemExit/KeyboardInterrupt/a bare BaseException/CancelledError, cancel
    their own task, wait out a short RetryAfter in their slot); every job's handler is
    entered once an attempt; after each batch the worker holds nothing, runs nothing and
    has no job parked."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=concurrency, prefetch=8)
    try:
        warm_up(slots)
        gauge_peak = 0

        @settings(
            max_examples=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        @given(batch=st.lists(JOBS, min_size=1, max_size=8))
        @example(batch=HEAVY)
        def check(batch):
            nonlocal gauge_peak
            slots.reset()
            specs = [
                JobSpec(
                    payload=(Work if kind == "sync" else AWork)(action=action, seconds=seconds),
                    max_attempts=2 if action == "retry-once" else 1,
                )
                for kind, action, seconds in batch
            ]
            jobs = enqueue_many(specs)
            deadline = time.monotonic() + 20
            while not ended(jobs):
                assert time.monotonic() < deadline, "the batch did not end within 20 s"
                gauge_peak = max(gauge_peak, worker.handlers_running)
                time.sleep(0.002)
            wait_for(lambda: books_closed(worker), what="the worker's books closed", interval=0.005)
            assert slots.peak <= concurrency, f"{slots.peak} handlers at once on {concurrency}"
            for job, (_, action, _) in zip(jobs, batch, strict=True):
                row = state_of(job)
                tries = 2 if action == "retry-once" else 1
                assert (slots.entered[job.id], row.attempts) == (tries, tries), action
                good = action in ("ok", "sleep", "retry-once")
                assert row.state == ("succeeded" if good else "failed"), action

        check()
        assert worker.slots.waiting.parked > 0, "no job was ever parked: the gate was not exercised"
        assert gauge_peak <= concurrency
    finally:
        stop(worker, thread)


def test_a_thread_only_worker_never_parks_a_job():
    """The plain thread-run path: a thread takes a held job only when it is free, so a slot is
    always free for it; no job is ever parked and the gate costs one comparison."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=3, prefetch=12)
    try:
        first = [enqueue(Work()) for _ in range(3)]
        wait_for(lambda: ended(first), what="the warm-up jobs ran", interval=0.005)
        load = enqueue_many(
            [Work(action="sleep", seconds=0.002) if n % 4 == 0 else Work() for n in range(160)]
        )
        most = 0
        deadline = time.monotonic() + 20
        while not ended(load):
            assert time.monotonic() < deadline, "the load did not drain within 20 s"
            most = max(most, worker.slots.in_flight)
            time.sleep(0.001)
    finally:
        stop(worker, thread)
    assert Job.objects.filter(pk__in=[j.id for j in load], state="succeeded").count() == 160
    assert most > 3, "prefetch held nothing beyond the threads"
    assert slots.peak <= 3
    assert worker.slots.waiting.parked == 0


def test_a_parked_job_resumed_by_a_handler_s_end_takes_that_slot():
    """A handler that ends starts the next held job: ``_finished`` hands the freed slot to
    the first parked job, and the slot is counted for it as ``_next_waiting`` pops it. No
    other held job that reaches ``_slot_taken`` first (through the pool's queue, or the
    loop) takes it, so the resumed job is never parked again behind jobs claimed after it
    (claim order, priority included, holds) and no hand-off is spent for nothing."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=2, prefetch=20)
    try:
        warm_up(slots)
        load = enqueue_many(
            [(Work if n % 2 else AWork)(action="sleep", seconds=0.003) for n in range(300)]
        )
        wait_for(lambda: ended(load), timeout=30, what="the load drained", interval=0.005)
    finally:
        stop(worker, thread)
    times = worker.slots.waiting.times
    assert times, "no job was parked"
    again = {job: n for job, n in times.items() if n > 1}
    assert not again, (
        f"{len(again)} of {len(times)} parked jobs were parked again after being resumed "
        f"(up to {max(again.values())} times)"
    )


# -- a parked job's own guarantees ---------------------------------------------------------------

BEHIND = {
    # (the long job that holds the only slot, the parked job)
    "sync-behind-async": (AWork, Timed),
    "async-behind-async": (AWork, ATimed),
    "sync-behind-sync": (Work, Timed),  # the thread-run prefetch of before: in the pool queue
}


@pytest.mark.parametrize("case", list(BEHIND))
def test_a_parked_job_s_timeout_runs_from_its_start_not_its_claim(case):
    """A job of a type with a 0.4 s timeout waits 1.2 s for the slot, then its handler
    returns at once: it succeeded. Its timeout clock (ctx.started) runs from its start, not
    its claim, so the lease keeper never tells it to stop before it has started and it does
    not end ``failed``/``deadline_exceeded`` with its one attempt spent."""
    long_type, parked_type = BEHIND[case]
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=1, prefetch=4)
    try:
        warm_up(slots)
        long = hold_the_slot(slots, long_type(action="sleep", seconds=1.2))
        parked = enqueue(parked_type(), max_attempts=1)
        wait_for(
            lambda: held_by(worker) == 2,
            what="the parked job held beside the long one",
            interval=0.005,
        )
        if case != "sync-behind-sync":
            wait_for(
                lambda: len(worker.slots.waiting) == 1,
                what="the job parked for a slot",
                interval=0.005,
            )
        wait_for(lambda: ended([parked]), timeout=10, what="the parked job ended", interval=0.005)
        row = state_of(parked)
        assert state_of(long).state in ("running", "succeeded")
    finally:
        stop(worker, thread)
    assert (row.state, row.last_error) == ("succeeded", ""), (
        f"the parked job ended {row.state} ({row.last_error}) after "
        f"{slots.entered[parked.id]} handler calls: {row.error_detail[:120]!r}"
    )


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_operator_cancel_stops_a_parked_job_before_its_handler(kind):
    """An operator cancels a job parked behind a long handler; the worker learns it at the
    next renewal, while the job still waits. When the slot frees, the job ends ``cancelled``
    without its handler being called (its side effects would happen after the operator said
    stop): the async one's task is cancelled before its first step, and the sync one's
    handler is checked for the cancel before it is called."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=1, prefetch=4, lease=timedelta(seconds=1.5))
    try:
        warm_up(slots)
        long = hold_the_slot(slots, AWork(action="sleep", seconds=2.0))
        parked = enqueue(Work() if kind == "sync" else AWork())
        wait_for(
            lambda: len(worker.slots.waiting) == 1, what="the job parked for a slot", interval=0.005
        )
        assert cancel_running([parked.id], by="ops") == [parked.id]
        wait_for(
            lambda: any(r.cancel_requested for r in held(worker, parked)),
            timeout=3,
            what="the worker learned of the cancel",
            interval=0.005,
        )
        assert slots.entered[parked.id] == 0 and state_of(long).state == "running"
        wait_for(lambda: ended([parked]), timeout=10, what="the parked job ended", interval=0.005)
        wait_for(lambda: books_closed(worker), what="the worker's books closed", interval=0.005)
    finally:
        stop(worker, thread)
    assert state_of(parked).state == "cancelled"
    assert slots.entered[parked.id] == 0, "the handler ran after the operator's cancel"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_parked_job_whose_lease_is_lost_never_runs_and_its_fresh_claim_runs_once(kind):
    """A parked job is taken away (its lease ends, a recovery requeues it) and this worker
    claims it again while the stale attempt still waits. The stale attempt never runs; the
    fresh claim runs once; nothing is left held."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=1, prefetch=4, lease=timedelta(seconds=1.5))
    try:
        warm_up(slots)
        hold_the_slot(slots, AWork(action="sleep", seconds=1.5))
        parked = enqueue(Work() if kind == "sync" else AWork())
        wait_for(
            lambda: len(worker.slots.waiting) == 1, what="the job parked for a slot", interval=0.005
        )
        stale_token = state_of(parked).claim_token
        stale = held(worker, parked)
        expire_and_requeue(parked)
        wait_for(
            lambda: stale[0].lost, timeout=3, what="the stale attempt given up", interval=0.005
        )
        wait_for(
            lambda: state_of(parked).state == "succeeded",
            timeout=10,
            what="it succeeded",
            interval=0.005,
        )
        wait_for(lambda: books_closed(worker), what="the worker's books closed", interval=0.005)
    finally:
        stop(worker, thread)
    assert slots.entered[parked.id] == 1
    assert stale_token not in slots.tokens[parked.id], "the stale attempt ran its handler"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_parked_job_whose_lease_is_lost_leaves_its_run_row_alone(kind):
    """A parked job bound to a run row is taken away while it waits (requeued, due in an
    hour). When the slot frees, the stale attempt writes nothing for the job: its run row
    stays ``queued`` with no attempt. Both paths check ``running.lost`` before they mark the
    row ``running`` for an attempt the worker no longer holds."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=1, prefetch=4, lease=timedelta(seconds=1.5))
    try:
        warm_up(slots)
        long = hold_the_slot(slots, AWork(action="sleep", seconds=1.2))
        row = Delivery.objects.create(job_id=f"parked-{kind}")
        parked = enqueue(Bound(run_id=row.pk) if kind == "sync" else ABound(run_id=row.pk))
        wait_for(
            lambda: len(worker.slots.waiting) == 1, what="the job parked for a slot", interval=0.005
        )
        stale = held(worker, parked)
        expire_and_requeue(parked, run_after=timezone.now() + timedelta(hours=1))
        wait_for(
            lambda: stale[0].lost, timeout=3, what="the stale attempt given up", interval=0.005
        )
        wait_for(
            lambda: state_of(long).state == "succeeded",
            timeout=10,
            what="the long job",
            interval=0.005,
        )
        wait_for(lambda: books_closed(worker), what="the worker's books closed", interval=0.005)
    finally:
        stop(worker, thread)
    assert slots.entered[parked.id] == 0
    assert state_of(parked).state == "queued"
    row.refresh_from_db()
    assert (row.state, row.attempts) == ("queued", 0), (
        f"the run row of a job this worker lost became {row.state} (attempt {row.attempts})"
    )


def test_parked_jobs_keep_their_leases_while_they_wait():
    """Jobs parked longer than a lease are renewed like any held job: none is given up, and
    each runs once and succeeds."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=1, prefetch=4, lease=timedelta(seconds=1.5))
    try:
        warm_up(slots)
        long = hold_the_slot(slots, AWork(action="sleep", seconds=2.4))
        parked = [enqueue(Work()), enqueue(AWork())]
        wait_for(
            lambda: len(worker.slots.waiting) == 2,
            what="both jobs parked for a slot",
            interval=0.005,
        )
        wait_for(lambda: ended([long, *parked]), timeout=10, what="every job ended", interval=0.005)
        wait_for(lambda: books_closed(worker), what="the worker's books closed", interval=0.005)
    finally:
        stop(worker, thread)
    for job in parked:
        row = state_of(job)
        assert (row.state, row.attempts, row.last_error) == ("succeeded", 1, "")
        assert slots.entered[job.id] == 1


# -- drains ---------------------------------------------------------------------------------------


def queued_untried(jobs) -> bool:
    ids = [j.id for j in jobs]
    untried = Job.objects.filter(pk__in=ids, state="queued", attempts=0, claim_token=None)
    return untried.count() == len(ids)


@pytest.mark.parametrize("with_lost", [False, True], ids=["parked", "parked-and-one-lost"])
def test_a_drain_hands_parked_jobs_back_at_once_and_ends_with_the_last_handler(with_lost):
    """Parked jobs of both kinds go back untried as the drain begins, never to run here; the
    drain ends when the running handler does, not at its shutdown timeout, also when a
    parked job was lost meanwhile (a drain does not hand that one back: it must still be
    resumed and dropped when the slot frees)."""
    slots = Slots()
    worker, thread = start(
        mixed(slots),
        concurrency=1,
        prefetch=6,
        lease=timedelta(seconds=1.5),
        shutdown_timeout=15,
    )
    try:
        warm_up(slots)
        long = hold_the_slot(slots, AWork(action="sleep", seconds=1.2))
        parked = [enqueue(Work()), enqueue(AWork()), enqueue(Work()), enqueue(AWork())]
        wait_for(
            lambda: len(worker.slots.waiting) == 4,
            what="the jobs parked for a slot",
            interval=0.005,
        )
        lost = None
        if with_lost:
            lost, parked = parked[0], parked[1:]
            stale = held(worker, lost)
            expire_and_requeue(lost, run_after=timezone.now() + timedelta(hours=1))
            wait_for(
                lambda: stale[0].lost, timeout=3, what="the parked job given up", interval=0.005
            )
        began = time.monotonic()
        worker.request_stop()
        wait_for(
            lambda: queued_untried(parked),
            timeout=1,
            what="the parked jobs handed back",
            interval=0.005,
        )
        assert state_of(long).state == "running"
        thread.join(8)
        took = time.monotonic() - began
    finally:
        stop(worker, thread)
    assert took < 4, f"the drain took {took:.1f}s for a handler of 1.2 s"
    assert state_of(long).state == "succeeded"
    assert all(slots.entered[j.id] == 0 for j in parked)
    if lost is not None:
        assert slots.entered[lost.id] == 0 and state_of(lost).state == "queued"
    assert books_closed(worker)


DRAIN_JOBS = st.tuples(st.sampled_from(["sync", "async"]), st.sampled_from([0.0, 0.01, 0.05]))


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(
    batch=st.lists(DRAIN_JOBS, min_size=2, max_size=10),
    started_before_stop=st.integers(min_value=0, max_value=9),
)
@example(batch=[("async", 0.05)] * 3 + [("sync", 0.05)] * 3, started_before_stop=1)
def test_a_drain_at_any_moment_runs_each_job_once_or_hands_it_back_untried(
    batch, started_before_stop
):
    """Whatever the mix and whenever the stop comes: each job either ran exactly once here
    and succeeded, or went back untried (``queued``, no attempt counted) and never ran; the
    drain ends with the last handler and leaves nothing held."""
    slots = Slots()
    worker, thread = start(mixed(slots), concurrency=2, prefetch=8, shutdown_timeout=10)
    jobs = []
    try:
        warm_up(slots)
        slots.reset()
        jobs = enqueue_many(
            [(Work if kind == "sync" else AWork)(action="sleep", seconds=s) for kind, s in batch],
            max_attempts=1,
        )
        k = min(started_before_stop, len(jobs) - 1)
        wait_for(
            lambda: sum(slots.entered[j.id] for j in jobs) >= k,
            what=f"{k} jobs started",
            interval=0.005,
        )
        began = time.monotonic()
        worker.request_stop()
        thread.join(10)
        took = time.monotonic() - began
        assert not thread.is_alive()
        assert took < 2, f"the drain took {took:.1f}s for jobs of 50 ms at most"
        assert books_closed(worker)
        for job in jobs:
            row = state_of(job)
            if row.state == "succeeded":
                assert (slots.entered[job.id], row.attempts) == (1, 1)
            else:
                assert (row.state, row.attempts, row.claim_token) == ("queued", 0, None)
                assert slots.entered[job.id] == 0, "a job handed back ran here"
    finally:
        stop(worker, thread)
        cancel([j.id for j in jobs], by="the next example")  # not for the next worker


def test_a_forced_stop_with_a_stubborn_async_handler_hands_parked_jobs_back():
    """A second stop while an async handler ignores its cancellation and jobs of both kinds
    wait for its slot: the parked jobs go back untried, the worker exits within its short
    grace while the loop is closed under the stubborn task, and the stubborn job keeps its
    lease (it still runs)."""
    slots = Slots()
    worker, thread = start(
        mixed(slots), concurrency=1, prefetch=6, shutdown_timeout=0.3, cancel_timeout=0.2
    )
    try:
        warm_up(slots)
        stubborn = hold_the_slot(slots, AWork(action="ignore-cancel", seconds=2.5))
        parked = [enqueue(Work()), enqueue(AWork()), enqueue(Work())]
        wait_for(
            lambda: len(worker.slots.waiting) == 3,
            what="the jobs parked for a slot",
            interval=0.005,
        )
        began = time.monotonic()
        worker.request_stop()
        worker.request_stop()  # forced
        thread.join(6)
        took = time.monotonic() - began
        assert not thread.is_alive()
        assert took < 3, f"a forced stop took {took:.1f}s"
        assert queued_untried(parked)
        assert all(slots.entered[j.id] == 0 for j in parked)
        assert state_of(stubborn).state == "running"  # abandoned with its lease
    finally:
        stop(worker, thread)
        wait_for(
            lambda: slots.active == 0, timeout=5, what="the stubborn handler ended", interval=0.005
        )


def test_a_drain_as_a_parked_job_is_resumed_does_not_wait_for_a_lost_one():
    """SIGTERM lands between a slot's hand-over to the first parked job and that job's start
    (forced here by a hook on ``Worker._resume``, which the worker calls right after
    ``_next_waiting`` gave the job the freed slot). The slot is counted for the job as it is
    popped, so the drain leaves it to run, and its end drops a lost job parked behind it
    (not handed back by a drain, it waits to be resumed and dropped). The drain never waits
    out its shutdown and cancel timeouts with nothing running, nor exits with a job held."""
    slots = Slots()
    worker, thread = start(
        mixed(slots),
        concurrency=1,
        prefetch=6,
        lease=timedelta(seconds=1.5),
        shutdown_timeout=3,
        cancel_timeout=1,
    )
    stopped_at: list[float] = []
    try:
        warm_up(slots)
        long = hold_the_slot(slots, AWork(action="sleep", seconds=1.0))
        first = enqueue(Work())
        wait_for(
            lambda: len(worker.slots.waiting) == 1, what="the first job parked", interval=0.005
        )
        lost = enqueue(AWork())
        wait_for(
            lambda: len(worker.slots.waiting) == 2, what="the second job parked", interval=0.005
        )
        stale = held(worker, lost)
        expire_and_requeue(lost, run_after=timezone.now() + timedelta(hours=1))
        wait_for(lambda: stale[0].lost, timeout=3, what="the second job given up", interval=0.005)
        resume = worker.executor._resume

        def stop_as_resumed(running) -> None:
            if running.job.id == first.id and not stopped_at:
                stopped_at.append(time.monotonic())
                worker.request_stop()
                # The drain begins before the job reaches its thread; it holds its slot
                # already (counted in by _next_waiting), so the drain leaves it to run.
                wait_for(
                    lambda: worker._stopping.is_set(),
                    timeout=3,
                    what="the drain began",
                    interval=0.005,
                )
            resume(running)

        worker.executor._resume = stop_as_resumed
        wait_for(
            lambda: stopped_at, timeout=5, what="the slot handed to the first job", interval=0.005
        )
        thread.join(10)
        took = time.monotonic() - stopped_at[0]
    finally:
        stop(worker, thread)
    assert state_of(long).state == "succeeded"
    # The job given the slot runs in it (once), and its end drops the lost one.
    assert state_of(first).state == "succeeded" and slots.entered[first.id] == 1
    assert slots.entered[lost.id] == 0
    assert took < 1.5, f"the drain took {took:.1f}s with no handler left to run"
