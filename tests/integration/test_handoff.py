"""Handing jobs to handler threads: few wake-ups, and never a job waiting behind a busy thread.

The pool wakes only as many sleeping threads as it is asked to for a batch; tasks that nobody
takes for a moment get more threads (the stall watch). These tests hold the guarantee that
makes waking few threads safe: while threads sleep, a task does not wait for a thread that
is busy with a long one. The worker side: a finished
handler does not make the loop claim its slot alone while outcomes wait to be written; the
slot is claimed in the pass that writes them.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import handoff
from jobs.worker import pool as pool_module
from jobs.worker import runner as runner_module
from jobs.worker.config import WorkerConfig
from jobs.worker.handoff import BLOCKED, thread_held
from jobs.worker.pool import HandlerPool
from jobs.worker.runner import Worker
from tests.acceptance.conftest import wait_for
from tests.worker_support import Recorder, Step, registry


def run_batches(
    pool: HandlerPool,
    batches: list[tuple[list[bool], int]],
    pauses: Sequence[float] = (),
) -> None:
    """Submit each batch (True: a task that blocks until released) waking ``wake`` threads,
    after its pause if given (the gap between passes); every quick task must finish while
    the blocking ones still hold their threads."""
    release = threading.Event()
    done: list[int] = []
    lock = threading.Lock()

    def task(number: int, blocks: bool):
        def run() -> None:
            if blocks:
                release.wait(30)
            with lock:
                done.append(number)

        return run

    quick = 0
    number = 0
    for (kinds, wake), pause in itertools.zip_longest(batches, pauses[: len(batches)]):
        if pause:
            time.sleep(pause)  # the gap between passes: not a wait for anything
        tasks = []
        for blocks in kinds:
            tasks.append(task(number, blocks))
            quick += not blocks
            number += 1
        pool.submit_many(tasks, wake=wake)
    try:
        wait_for(lambda: len(done) == quick, what=f"{quick} quick tasks done")
        assert not release.is_set()
    finally:
        release.set()
    wait_for(lambda: len(done) == number, what="every task done")


def test_tasks_behind_a_blocked_thread_start_on_the_idle_ones():
    pool = HandlerPool(4)
    try:
        run_batches(pool, [([True, False, False, False], 1)])
    finally:
        assert pool.shutdown(timeout=5)


def draw_batches(
    data: st.DataObject, size: int, count: st.SearchStrategy[int], *, max_tasks: int
) -> list[tuple[list[bool], int]]:
    """Batches for a pool of ``size`` threads: each a mix of blocking (True) and quick tasks,
    fewer blocking in all than threads, and a number of threads to wake for it."""
    blocking_left = size - 1
    batches = []
    for _ in range(data.draw(count, label="batches")):
        kinds = data.draw(st.lists(st.booleans(), min_size=1, max_size=max_tasks), label="tasks")
        kept = []
        for blocks in kinds:
            blocks = blocks and blocking_left > 0
            blocking_left -= blocks
            kept.append(blocks)
        batches.append((kept, data.draw(st.integers(1, len(kept)), label="wake")))
    return batches


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    size=st.integers(2, 6),
    data=st.data(),
)
def test_no_task_waits_for_a_busy_thread_while_one_sleeps(size, data):
    """Any mix of blocking and quick tasks, in any batches, waking any number of threads:
    with fewer blocking tasks than threads, every quick task finishes while they block."""
    batches = draw_batches(data, size, st.integers(1, 3), max_tasks=8)
    pool = HandlerPool(size)
    try:
        run_batches(pool, batches)
        assert pool.alive == size
    finally:
        assert pool.shutdown(timeout=5)


@pytest.mark.django_db(transaction=True)
def test_a_freed_slot_is_claimed_with_the_outcomes_waiting_not_before(monkeypatch):
    """Six slow jobs hold six of eight slots while quick ones cycle through the other two: no
    pass claims alone while an outcome that was waiting before the pass is left unwritten."""
    recorder = Recorder()
    for _ in range(6):
        enqueue(Step(plan=("slow",), seconds=1.5), priority=10)
    quick = [enqueue(Step(plan=("ok",))) for _ in range(12)]
    worker = Worker(
        registry(recorder, concurrency=None),
        WorkerConfig(
            install_signal_handlers=False, concurrency=8, poll_interval=0.05, ack_interval=0.1
        ),
    )
    took_at = [0.0]
    take_acks = worker.completer.take

    def timed_take(now):
        took_at[0] = time.monotonic()
        return take_acks(now)

    monkeypatch.setattr(worker.completer, "take", timed_take)
    alone: list[int] = []
    passes: list[tuple[int, int]] = []
    record_and_claim = runner_module.queue.record_and_claim

    def watched(outcomes, requests, **kwargs):
        asked = sum(r.limit for r in requests)
        with worker.slots.lock:
            waited = (
                worker.completer.first_at is not None and worker.completer.first_at < took_at[0]
            )
        if asked and not outcomes and waited:
            alone.append(asked)
        passes.append((len(outcomes), asked))
        return record_and_claim(outcomes, requests, **kwargs)

    monkeypatch.setattr(runner_module.queue, "record_and_claim", watched)
    ids = {job.id for job in quick}

    def done(w: Worker) -> bool:
        ran = sum(1 for _, ctx in recorder.calls if ctx.id in ids)
        return ran == len(ids) and w.idle

    deadline = time.monotonic() + 20
    worker.run(until=lambda w: done(w) or time.monotonic() > deadline)

    assert done(worker), f"quick jobs ran: {len(recorder.calls)}"
    assert not alone, f"passes that claimed a freed slot alone while outcomes waited: {alone}"
    assert any(written and asked for written, asked in passes), passes


@pytest.mark.django_db(transaction=True)
def test_handlers_that_wait_a_few_milliseconds_on_io_each_get_a_thread_at_once():
    """Handlers that block briefly (a 3 ms query, a call to a nearby service) hold their
    thread without using the CPU: once such jobs have run, a pass's jobs start side by side,
    not one after another on one thread until the stall watch wakes more."""
    starts: list[tuple[float, int]] = []  # (when a handler started, its job's id)
    lock = threading.Lock()

    def waits_on_io(payload: Step, ctx) -> None:
        with lock:
            starts.append((time.monotonic(), ctx.id))
        time.sleep(0.003)

    passes = drain_in_passes(waits_on_io, starts, concurrency=10)
    spreads = [max(s) - min(s) for s in passes if len(s) >= 5]
    assert spreads, passes
    # Side by side: started within a couple of ms. One after another: 12 ms and more.
    assert statistics.median(spreads) < 0.008, spreads


def drain_in_passes(
    handler, starts, *, concurrency: int, jobs: int = 80, **config
) -> list[list[float]]:
    """Run ``jobs`` Step jobs with ``handler`` (which appends its start time and its job's id
    to ``starts``) and return the handler start times of each pass's jobs, the first two
    passes left out (no handler had run before them)."""
    worker = Worker(
        Registry([JobType(Step, handler, Policy(concurrency=None))]),
        WorkerConfig(
            install_signal_handlers=False, concurrency=concurrency, poll_interval=0.05, **config
        ),
    )
    for _ in range(jobs):
        enqueue(Step(plan=("sleep",), seconds=0.003))
    worker.run(until=lambda w: len(starts) >= jobs and w.idle)
    # A pass's claim is one statement: the jobs it claimed share its clock (started_at).
    claimed_at = dict(Job.objects.values_list("id", "started_at"))
    passes: dict[object, list[float]] = {}
    for started, job in starts:
        passes.setdefault(claimed_at[job], []).append(started)
    return [passes[at] for at in sorted(passes)][2:]


@pytest.mark.django_db(transaction=True)
def test_with_few_slots_a_pass_waits_for_short_handlers_to_claim_every_slot():
    """Ten slots, handlers of a few ms that barely use the CPU: when half the slots are free,
    the other half will be in a moment, so the pass waits for them (up to ack_interval) and
    claims for all ten; passes of five cost two passes' fixed cost for ten jobs."""
    starts: list[tuple[float, int]] = []  # (when a handler started, its job's id)
    lock = threading.Lock()

    def short(payload: Step, ctx) -> None:
        with lock:
            starts.append((time.monotonic(), ctx.id))
        time.sleep(0.0005)

    # A wait of up to 50 ms: long enough for ten such handlers on a busy machine.
    passes = drain_in_passes(short, starts, concurrency=10, ack_interval=0.05)
    assert statistics.median(len(p) for p in passes) >= 8, [len(p) for p in passes]


def test_a_handler_counts_by_its_cpu_time_unless_it_waited_on_io():
    # Waiting a millisecond or two is mostly other threads holding the interpreter's lock:
    # counted in full it would wake more threads for the next pass, which wait longer.
    assert thread_held(ran=0.002, cpu=0.00002) == 0.00002
    # A handler that waited on I/O for longer holds its thread that long.
    assert thread_held(ran=0.050, cpu=0.0001) == 0.050
    assert thread_held(ran=BLOCKED + 0.001, cpu=0.0005) == BLOCKED + 0.001


def test_a_batch_of_blocking_tasks_gets_a_thread_each_within_a_few_stall_intervals():
    """Woken for one task, a pool gives each of eight tasks that block a thread of its own
    (the stall watch wakes one, then two, then four)."""
    pool = HandlerPool(8)
    started: list[float] = []
    release = threading.Event()

    def block() -> None:
        started.append(time.monotonic())
        release.wait(30)

    try:
        submitted = time.monotonic()
        pool.submit_many([block] * 8, wake=1)
        wait_for(lambda: len(started) == 8, what="every blocking task started")
        assert max(started) - submitted < 1.0
    finally:
        release.set()
        assert pool.shutdown(timeout=5)


def test_the_stall_watch_keeps_looking_for_a_while_before_it_sleeps_until_woken(monkeypatch):
    """A drain of short jobs submits a batch every pass, a millisecond or two apart, and its
    threads take each at once. A watch that slept until woken whenever it found no task would
    be woken for every batch (a system call for the run loop, a turn at the GIL for the
    watch); instead it keeps looking every ``STALL_AFTER`` for ``WATCH_LINGER`` after it was
    last woken or found tasks waiting, and batches meanwhile do not wake it: at most one
    wake-up a ``WATCH_LINGER`` (here a second), where there was one a batch."""
    monkeypatch.setattr(pool_module, "WATCH_LINGER", 1.0)
    pool = HandlerPool(4)
    wakes: list[float] = []
    notify = pool._stalls.notify

    def counted(n: int = 1) -> None:
        wakes.append(time.monotonic())
        notify(n)

    pool._stalls.notify = counted  # type: ignore[method-assign]
    done: list[int] = []
    try:
        # A new pool's watch lingers too, then sleeps until a batch wakes it.
        wait_for(lambda: pool._watch_idle, what="the new pool's watch asleep")
        for batch in range(1, 21):
            pool.submit_many([lambda: done.append(1)] * 3, wake=1)
            wait_for(lambda batch=batch: len(done) == 3 * batch, what="the batch done")
        assert wakes, "the first batch woke the sleeping watch"
        lingers = (time.monotonic() - wakes[0]) / 1.0
        assert len(wakes) <= 1 + int(lingers), (len(wakes), lingers)
        wait_for(lambda: pool._watch_idle, what="the watch asleep until woken")
        assert time.monotonic() - wakes[-1] >= 1.0 - 0.05
    finally:
        assert pool.shutdown(timeout=5)


@pytest.mark.django_db(transaction=True)
def test_one_handler_held_up_does_not_make_the_next_passes_wake_many_threads(monkeypatch):
    """A handler that took long once (here it waits 30 ms; on a busy machine, a wait for a
    CPU or the interpreter's lock) must not make the passes after it wake a thread a job for
    short handlers: those threads would only wait for each other in turn."""
    woken: list[tuple[float, int | None]] = []
    submit_many = HandlerPool.submit_many

    def recording(self, tasks, *, wake=None):
        tasks = list(tasks)
        woken.append((time.monotonic(), wake))
        return submit_many(self, tasks, wake=wake)

    monkeypatch.setattr(HandlerPool, "submit_many", recording)
    slow_done: list[float] = []

    def handler(payload: Step, ctx) -> None:
        if payload.seconds:
            time.sleep(payload.seconds)
            slow_done.append(time.monotonic())

    worker = Worker(
        Registry([JobType(Step, handler, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=10, poll_interval=0.05),
    )
    for _ in range(10):
        enqueue(Step(plan=("ok",)), priority=10)
    enqueue(Step(plan=("sleep",), seconds=0.03), priority=5)
    for _ in range(80):
        enqueue(Step(plan=("ok",)))
    worker.run(until=lambda w: w.idle and not Job.objects.exclude(state="succeeded").exists())

    assert slow_done
    after = [wake for at, wake in woken if at > slow_done[0]]
    assert after, woken
    assert max(after) <= 2, after


def test_tasks_waiting_behind_python_that_runs_get_threads_slowly():
    """Tasks wait untaken while the one thread woken runs Python (or waits for a CPU): more
    threads would only take turns with it. The watch wakes one at most every 100 ms then,
    not twice as many every 10 ms as for tasks waiting behind I/O."""
    pool = HandlerPool(8)
    started: list[float] = []

    def compute() -> None:
        started.append(time.monotonic())
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # Python running, not waiting on I/O
            sum(range(100))

    try:
        submitted = time.monotonic()
        pool.submit_many([compute] * 6, wake=1)
        wait_for(lambda: len(started) == 6, what="every task started")
        early = [at - submitted for at in started if at - submitted < 0.15]
    finally:
        assert pool.shutdown(timeout=10)
    assert len(early) <= 2, early


def _count_cpu_clock_reads(monkeypatch) -> list[str]:
    """The names of the threads that read their CPU clock, one entry a read."""
    reads: list[str] = []
    thread_time = time.thread_time

    def counted() -> float:
        reads.append(threading.current_thread().name)
        return thread_time()

    monkeypatch.setattr(time, "thread_time", counted)
    return reads


@pytest.mark.django_db(transaction=True)
def test_a_handlers_cpu_time_is_read_at_most_once_a_job(monkeypatch):
    """Reading a thread's CPU clock is a system call that takes the scheduler's lock: read
    twice a job it cost a tenth of a busy worker's Python time. A job measured reads it once,
    at its end; its CPU time is the thread's since the end of its previous job (the pool's
    loop in between takes a few microseconds)."""
    reads = _count_cpu_clock_reads(monkeypatch)
    jobs_run = 40
    for _ in range(jobs_run):
        enqueue(Step(plan=("ok",)))
    worker = Worker(
        Registry([JobType(Step, lambda payload, ctx: None, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=4, poll_interval=0.05),
    )
    worker.run(until=lambda w: w.idle and not Job.objects.exclude(state="succeeded").exists())

    threads = set(reads)
    assert len(reads) <= jobs_run + len(threads), (len(reads), threads)
    assert worker.slots.times.shortest is not None  # and the hand-off still has its figure


def _drain_steps(count: int, seconds: float, concurrency: int) -> Worker:
    def handler(payload: Step, ctx) -> None:
        if payload.seconds:
            time.sleep(payload.seconds)

    worker = Worker(
        Registry([JobType(Step, handler, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=concurrency, poll_interval=0.05),
    )
    for _ in range(count):
        enqueue(Step(plan=("ok",), seconds=seconds))
    worker.run(until=lambda w: w.idle and not Job.objects.exclude(state="succeeded").exists())
    return worker


@pytest.mark.django_db(transaction=True)
def test_short_handlers_read_their_threads_cpu_clock_once_an_interval_not_once_a_job(
    monkeypatch,
):
    """Reading a thread's CPU clock is a system call that takes the scheduler's lock (about 5 %
    of a worker's CPU read once a job, for jobs of microseconds): a thread reads it for its
    first job, then only once ``CPU_SAMPLE_INTERVAL`` has passed since it last did, or after
    a job that ran that long. With the interval made a minute, each thread reads it for its
    first job only (twice: at its start and end)."""
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 60.0)
    reads = _count_cpu_clock_reads(monkeypatch)
    _drain_steps(200, 0.0, concurrency=4)
    assert len(reads) <= 2 * 4, len(reads)


@pytest.mark.django_db(transaction=True)
def test_handlers_that_run_longer_than_the_interval_are_each_measured(monkeypatch):
    """A job that ran at least ``CPU_SAMPLE_INTERVAL`` makes its thread measure the next one:
    handlers waiting on I/O keep teaching the hand-off how long they hold their thread."""
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 0.002)
    worker = _drain_steps(12, 0.008, concurrency=1)
    # One thread, one job at a time: every job measured (the first as the thread's first),
    # each holding its thread for its whole wait (longer than BLOCKED).
    assert len(worker.slots.times.recent) == 12, list(worker.slots.times.recent)
    assert min(worker.slots.times.recent) >= 0.008
