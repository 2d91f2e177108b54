"""Handing jobs to handler threads: few wake-ups, and never a job waiting behind a busy thread.

The pool wakes only as many sleeping threads as it is asked to for a batch; tasks that nobody
takes for a moment get more threads (the stall watch). These tests hold the guarantee that
makes waking few threads safe: while threads sleep, a task does not wait for a thread that
is busy with a long one. The worker side: a finished
handler does not make the loop claim its slot alone while outcomes wait to be written; the
slot is claimed in the pass that writes them.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import Payload, enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import executor as executor_module
from jobs.worker import handoff
from jobs.worker import pool as pool_module
from jobs.worker import runner as runner_module
from jobs.worker.config import WorkerConfig
from jobs.worker.handoff import BLOCKED, CPU_SAMPLE_INTERVAL, thread_held
from jobs.worker.pool import HandlerPool
from jobs.worker.runner import Worker
from tests.support.handler_pool import draw_batches, run_batches
from tests.support.polling import wait_for
from tests.support.worker import Recorder, Step, fake_held_job, registry


def test_tasks_behind_a_blocked_thread_start_on_the_idle_ones():
    pool = HandlerPool(4)
    try:
        run_batches(pool, [([True, False, False, False], 1)])
    finally:
        assert pool.shutdown(timeout=5)


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
    # One after another, the smallest pass counted (5 jobs) spreads over 4 x 3 = 12 ms and
    # more; side by side, within a few ms (thread wake-ups on a busy 2-core machine add some).
    assert statistics.median(spreads) < 0.011, spreads


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
        wait_for(lambda: len(started) == 8, what="every blocking task started", timeout=20)
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
        wait_for(lambda: pool._watch_idle, what="the new pool's watch asleep", timeout=20)
        for batch in range(1, 21):
            pool.submit_many([lambda: done.append(1)] * 3, wake=1)
            wait_for(lambda batch=batch: len(done) == 3 * batch, what="the batch done", timeout=20)
        assert wakes, "the first batch woke the sleeping watch"
        lingers = (time.monotonic() - wakes[0]) / 1.0
        assert len(wakes) <= 1 + int(lingers), (len(wakes), lingers)
        wait_for(lambda: pool._watch_idle, what="the watch asleep until woken", timeout=20)
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
        wait_for(lambda: len(started) == 6, what="every task started", timeout=20)
        early = [at - submitted for at in started if at - submitted < 0.15]
    finally:
        assert pool.shutdown(timeout=10)
    # Behind I/O all six start within 150 ms. Here two, and a third on a host so loaded that
    # the first thread's CPU time stalls as a wait would (it then looks like waiting on I/O).
    assert len(early) <= 3, early


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


NAME = "hostile.a.v1"


def _fake_running(job_id: int) -> SimpleNamespace:
    return fake_held_job(NAME, job_id)


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.django_db
def test_a_handlers_held_time_does_not_count_the_threads_cpu_between_jobs(monkeypatch):
    """A job's CPU count starts at its own start, not at the thread's previous job's end, so CPU
    the pool thread spent between two jobs (an async job's steps it served as a JobThread,
    anything) is not charged to the next job. Without a pool (as here) the clock is read at
    the start.
    """
    from jobs.catalogue.registry import Registry

    worker = runner_module.Worker(Registry())
    monkeypatch.setattr(executor_module, "execute", lambda running, **kwargs: None)

    def on_handler_thread() -> None:
        worker.executor.run_on_thread(_fake_running(1))
        _burn(0.3)  # the pool thread serves something else between the two jobs
        worker.executor.run_on_thread(_fake_running(2))

    thread = threading.Thread(target=on_handler_thread)
    thread.start()
    thread.join()
    _first, second = list(worker.slots.times.recent)
    assert second < 0.1, f"an instant handler counted as holding its thread {second:.3f}s"


@pytest.mark.django_db
def test_cpu_a_pool_thread_spends_on_another_task_is_not_a_jobs(monkeypatch):
    """On a real pool: between two jobs the thread serves another task (an async job's steps
    borrow pool threads); the second job reads its own start, so an instant handler does not
    count as holding its thread for the other task's CPU.
    """
    from jobs.catalogue.registry import Registry
    from jobs.worker.pool import HandlerPool

    worker = runner_module.Worker(Registry())
    monkeypatch.setattr(executor_module, "execute", lambda running, **kwargs: None)
    # Every job measured (a thread now reads its CPU clock once per CPU_SAMPLE_INTERVAL):
    # what is pinned here is the chained read of the jobs that are.
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 0.0)
    pool = worker.executor.pool = HandlerPool(1)
    done = threading.Event()
    try:
        pool.submit_many(
            [
                lambda: worker.executor.run_on_thread(_fake_running(1)),
                lambda: worker.executor.run_on_thread(_fake_running(2)),
                lambda: _burn(0.3),
                lambda: worker.executor.run_on_thread(_fake_running(3)),
                done.set,
            ]
        )
        assert done.wait(10)
    finally:
        assert pool.shutdown(timeout=5)
    _first, back_to_back, after_other_task = worker.slots.times.recent
    assert after_other_task < 0.1, f"an instant handler held its thread {after_other_task:.3f}s"
    assert back_to_back < 0.1


def bare_worker() -> Worker:
    return Worker(
        Registry([JobType(Step, lambda payload, ctx: None, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=1),
    )


def fake_running(work) -> SimpleNamespace:
    """What ``run_on_thread`` and ``finished`` read of a held job; ``work`` is its handler."""
    return fake_held_job("test.step.v1", work=work)


def recorded(worker: Worker, monkeypatch) -> list[tuple[float | None, float | None]]:
    """(ran, held) of each job ``run_on_thread`` finishes; the handler is ``running.work``."""
    monkeypatch.setattr(
        executor_module, "execute", lambda running, **kwargs: running.work() and None
    )
    seen: list[tuple[float | None, float | None]] = []
    finished = worker.executor.finished

    def record(running, outcome, *, ran=None, held=None) -> None:
        seen.append((ran, held))
        finished(running, outcome, ran=ran, held=held)

    worker.executor.finished = record  # type: ignore[method-assign]
    return seen


def burn(seconds: float) -> None:
    """Run Python on this thread for ``seconds`` of its CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(50))


def test_execute_outside_run_has_no_pool_and_measures_by_the_interval(monkeypatch):
    """``_execute`` called on a thread of no pool and before any ``run()`` (no ``_pool``):
    no exception; the thread's first job is measured, the next ones within the interval are
    not, the one after a job that ran the interval is; every job counts in the mean run
    time prefetch goes by; a second thread keeps its own state."""
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 0.1)  # ample on a busy machine
    worker = bare_worker()
    assert not hasattr(worker, "_pool")
    seen = recorded(worker, monkeypatch)
    worker.executor.run_on_thread(fake_running(lambda: None))
    worker.executor.run_on_thread(fake_running(lambda: None))
    worker.executor.run_on_thread(fake_running(lambda: time.sleep(0.1)))
    worker.executor.run_on_thread(fake_running(lambda: None))
    measured = [held is not None for _, held in seen]
    assert measured[0] and not measured[1] and measured[3], seen
    assert all(ran is not None for ran, _ in seen)
    assert worker.slots.times.mean is not None and worker.slots.times.mean > 0.0005

    other: list[BaseException] = []

    def on_another_thread() -> None:
        try:
            worker.executor.run_on_thread(fake_running(lambda: None))
        except BaseException as exc:  # pragma: no cover - the failure reported below
            other.append(exc)

    thread = threading.Thread(target=on_another_thread)
    thread.start()
    thread.join(10)
    assert not other
    assert seen[-1][1] is not None  # its first job: measured


def test_a_handed_back_job_leaves_the_threads_measuring_state_alone(monkeypatch):
    """A job a drain handed back before the thread took it returns at once: the next job
    still reads the clock afresh (the task number moved on) and nothing raises."""
    worker = bare_worker()
    seen = recorded(worker, monkeypatch)
    pool = worker.executor.pool = HandlerPool(1)
    try:
        long_job = fake_running(lambda: time.sleep(CPU_SAMPLE_INTERVAL + 0.002))
        handed = fake_running(lambda: burn(0.05))
        handed.handed_back = True
        after = fake_running(lambda: None)
        pool.submit_many(
            [
                lambda: worker.executor.run_on_thread(long_job),
                lambda: worker.executor.run_on_thread(handed),
                lambda: worker.executor.run_on_thread(after),
            ]
        )
        wait_for(lambda: len(seen) == 2, what="two jobs finished", interval=0.005)
    finally:
        assert pool.shutdown(timeout=5)
    (_, held), (ran2, held2) = seen
    assert held is not None and held2 is not None
    assert held2 <= ran2 + 0.001, seen


# Kinds of task on one pool thread, in order: a job of the worker (quick, CPU-bound, or
# waiting on I/O), or another pool task between jobs (an async job's borrowed steps).
TASKS = st.lists(
    st.tuples(
        st.sampled_from(["quick", "burn", "io", "step"]),
        st.sampled_from([0.0, 0.0, 0.004]),  # a pause before it: the thread sleeps
    ),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(tasks=TASKS)
def test_a_measured_job_never_counts_another_tasks_cpu_and_long_ones_are_followed(
    tasks, monkeypatch
):
    """Any sequence of jobs, other pool tasks that burn the CPU (an async job's steps on a
    borrowed thread) and pauses, on one pool thread, with the interval made 3 ms: a job's
    CPU time is read from the previous task's end only when that task was a measured job,
    so no measured job counts more CPU than it ran; the thread's first job and every job
    after one that ran the interval are measured; every job counts in the mean."""
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 0.003)
    worker = bare_worker()
    seen = recorded(worker, monkeypatch)
    pool = worker.executor.pool = HandlerPool(1)
    work = {
        "quick": lambda: None,
        "burn": lambda: burn(0.002),
        "io": lambda: time.sleep(0.004),
    }
    steps: list[int] = []
    jobs = 0
    try:
        for kind, pause in tasks:
            if pause:
                wait_for(
                    lambda: pool.busy == 0 and not pool._tasks,
                    what="the thread free",
                    interval=0.005,
                )
                time.sleep(pause)  # the thread asleep between tasks: not a wait for anything
            if kind == "step":
                pool.submit(lambda: (burn(0.006), steps.append(1)))
            else:
                running = fake_running(work[kind])
                pool.submit(lambda running=running: worker.executor.run_on_thread(running))
                jobs += 1
        wait_for(
            lambda: len(seen) == jobs and pool.busy == 0, what="every task run", interval=0.005
        )
    finally:
        assert pool.shutdown(timeout=5)
    for ran, held in seen:
        assert ran is not None
        # The thread's own work between two tasks counts too: on a loaded machine, a few
        # hundred µs to a millisecond. A step's 6 ms would be far over.
        assert held is None or held <= ran + 0.003, seen
    if seen:
        assert seen[0][1] is not None, seen  # the thread's first job
        assert worker.slots.times.mean is not None
    for (ran, _), (_, held_next) in itertools.pairwise(seen):
        if ran >= 0.003:
            assert held_next is not None, seen


class Nap(Payload, name="test.handoff.nap.v1"):
    seconds: float = 0.0


async def async_nap(payload: Nap, ctx) -> None:
    await asyncio.sleep(payload.seconds)


def sync_step(payload: Step, ctx) -> None:
    if payload.seconds:
        time.sleep(payload.seconds)


def all_done() -> bool:
    return not Job.objects.exclude(state="succeeded").exists()


@pytest.mark.django_db(transaction=True)
def test_a_long_handler_after_a_burst_of_short_ones_is_learned(caplog):
    """Short handlers, then handlers that wait 12 ms on I/O: the first long one on a thread
    may go unmeasured (its thread read the clock within the interval), but each long one
    makes its thread measure the next, so the hand-off's sample ends all long (its shortest
    at least the wait), as a worker needs to stop waking one thread for a batch of them."""
    for _ in range(60):
        enqueue(Step(plan=("ok",)), priority=10)
    for _ in range(45):
        enqueue(Step(plan=("sleep",), seconds=0.012))
    worker = Worker(
        Registry([JobType(Step, sync_step, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=2, poll_interval=0.05),
    )
    worker.run(until=lambda w: w.idle and all_done())
    assert len(worker.slots.times.recent) == handoff.RECENT_RUNS
    assert min(worker.slots.times.recent) >= 0.012, sorted(worker.slots.times.recent)[:5]
    assert "worker error" not in caplog.text


@pytest.mark.django_db(transaction=True)
def test_async_jobs_borrowing_threads_between_sync_ones_break_no_measurement(caplog, monkeypatch):
    """Async jobs borrow a pool thread for their steps between the sync jobs the same threads
    run: every job succeeds, nothing raises in the measuring, and no measured handler counts
    more CPU time than it ran (a borrowed thread's steps are not read as the next job's)."""
    for i in range(60):
        if i % 3 == 0:
            enqueue(Nap(seconds=0.002))
        else:
            enqueue(Step(plan=("ok",), seconds=0.015 if i % 7 == 0 else 0.0))
    worker = Worker(
        Registry(
            [
                JobType(Step, sync_step, Policy(concurrency=None)),
                JobType(Nap, async_nap, Policy(concurrency=None)),
            ]
        ),
        WorkerConfig(install_signal_handlers=False, concurrency=3, poll_interval=0.05),
    )
    seen: list[tuple[float | None, float | None]] = []
    finished = worker.executor.finished

    def record(running, outcome, *, ran=None, held=None) -> None:
        seen.append((ran, held))
        finished(running, outcome, ran=ran, held=held)

    monkeypatch.setattr(worker.executor, "finished", record)
    worker.run(until=lambda w: w.idle and all_done())
    measured = [(ran, held) for ran, held in seen if held is not None]
    assert measured and len(seen) == 60
    assert all(held <= ran + 0.001 for ran, held in measured), measured
    assert worker.handlers_running == 0 and worker.slots.in_flight == 0
    assert "worker error" not in caplog.text
    assert "handler task crashed" not in caplog.text
