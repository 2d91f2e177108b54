"""Review of 8bc5ca0 and 37c60ce: the CPU clock read once per 10 ms, and the lingering watch.

8bc5ca0: a handler thread reads its CPU clock for a job only when ``CPU_SAMPLE_INTERVAL`` has
passed since its last read, or after a job that ran that long; unmeasured jobs add nothing
to the hand-off's sample (``_recent_held``) but still to the mean run time prefetch goes by.
Checked here: the chained read never counts another task's CPU (an async job's borrowed
steps between two jobs), ``_execute`` outside ``run()``, the documented sampling rule, the
hand-off learning long handlers after a burst of short ones, prefetch and a drain.

37c60ce: the pool's stall watch keeps looking every ``STALL_AFTER`` for ``WATCH_LINGER``
after it was last woken or found tasks waiting, then sleeps until a batch wakes it. Checked
here: the pool's guarantee (no task waits for a busy thread while a thread sleeps) across
batches that come while the watch lingers, as it goes to sleep and after; an idle pool's
and an idle worker's watch asleep, not polling; shutdown from either state.

DEFECT (37c60ce): a look that follows a lingering poll judges whether the process is busy
over the few microseconds since that poll ended, in which the only thing that ran is the
watch itself, so it is always "busy". When the batch has already waited ``STALL_AFTER`` by
then (it came as the poll began, or the watch got the CPU back a moment late) the look wakes
no thread (a busy process waits ``BUSY_STALL_AFTER``) and the tasks wait another
``STALL_AFTER``: twice what the commit promises ("a stall is still seen STALL_AFTER after
the batch"), and what the old watch, woken by the batch, took. The two tests named
``..._the_first_look_due_...`` failed on it; fixed in the next commit by measuring the CPU
share over the lingering wait itself, and anew only from full waits.

Pool tests drive ``HandlerPool`` directly; worker tests run a real ``Worker`` on PostgreSQL.
Waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import Payload, enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import executor as executor_module
from jobs.worker import handoff
from jobs.worker import pool as pool_module
from jobs.worker.config import WorkerConfig
from jobs.worker.handoff import CPU_SAMPLE_INTERVAL
from jobs.worker.pool import STALL_AFTER, HandlerPool
from jobs.worker.runner import Worker
from tests.integration.test_handoff import draw_batches, run_batches
from tests.worker_support import Step, fake_held_job, running_worker, wait_for

# -- the stall watch on a simulated clock ---------------------------------------------------------

#: How long the watch runs between two reads of a clock in the simulation (seconds).
WATCH_STEP = 1e-6


class _Done(Exception):
    """Ends a simulated run of the watch."""


class _SimClock:
    """The ``time`` module as the stall watch sees it, on the simulating thread: while the
    watch runs it is the one thing running, so the process's CPU clock moves with the wall
    clock (``WATCH_STEP`` a read); while it waits, only the wall clock moves. Other threads
    see the real clocks."""

    def __init__(self, start: float) -> None:
        self.wall = start
        self.cpu = 1.0
        self._owner = threading.get_ident()

    def __getattr__(self, name: str):
        return getattr(time, name)

    def monotonic(self) -> float:
        if threading.get_ident() != self._owner:
            return time.monotonic()
        self.wall += WATCH_STEP
        self.cpu += WATCH_STEP
        return self.wall

    def process_time(self) -> float:
        if threading.get_ident() != self._owner:
            return time.process_time()
        self.wall += WATCH_STEP
        self.cpu += WATCH_STEP
        return self.cpu


class _SimConditions:
    """The pool's two conditions (one lock) for a simulated run: a batch of two tasks comes at
    ``arrival``; the thread woken for it takes the first at once and blocks in it (no CPU),
    three threads sleep. Every timed wait ends ``late`` after its timeout (a timer's slack, a
    turn at the CPU), a notified one ``late`` after the notice. The run ends at the first
    thread the watch wakes."""

    def __init__(self, pool: HandlerPool, clock: _SimClock, arrival: float, late: float):
        self.pool, self.clock, self.arrival, self.late = pool, clock, arrival, late
        self.arrived = False
        self.woken_at: float | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def _arrive(self) -> None:
        self.arrived = True
        self.pool._tasks.append(lambda: None)  # the second task: nobody takes it
        self.pool._taken_at = self.arrival

    def wait(self, timeout: float | None = None) -> bool:
        clock = self.clock
        if timeout is None:  # asleep until a batch: submit_many notifies it
            if self.arrived:
                raise _Done
            clock.wall = max(clock.wall, self.arrival) + self.late
            self._arrive()
            return True
        clock.wall += timeout + self.late
        if not self.arrived and self.arrival <= clock.wall:
            self._arrive()
        if clock.wall > self.arrival + 1.0:
            raise _Done
        return False

    def notify(self, n: int = 1) -> None:  # _wake_locked: a thread woken for the tasks
        if self.woken_at is None:
            self.woken_at = self.clock.wall
        raise _Done


def first_wake_after(arrival: float, late: float) -> float | None:
    """How long after a batch that comes ``arrival`` seconds after the pool started the stall
    watch wakes a thread for the task nobody took (None: not within a second)."""
    start = 1000.0
    clock = _SimClock(start)
    pool = HandlerPool.__new__(HandlerPool)  # no threads: the watch runs on this one
    pool._tasks = deque()
    pool._sleeping, pool._waking = 3, 0
    pool._taken_at = start
    pool._watch_idle = False
    pool._closing = False
    conditions = _SimConditions(pool, clock, start + arrival, late)
    pool._ready = pool._stalls = conditions
    real_time = pool_module.time
    pool_module.time = clock
    try:
        pool._watch_stalls()
    except _Done:
        pass
    finally:
        pool_module.time = real_time
    return None if conditions.woken_at is None else conditions.woken_at - (start + arrival)


@settings(max_examples=300, deadline=None)
@given(
    arrival=st.floats(0.0, 0.25),
    late=st.sampled_from([0.0, 0.00005, 0.0002, 0.001, 0.002]),
)
@example(arrival=0.0, late=0.0002)  # the batch comes as a lingering look's wait begins
@example(arrival=0.5, late=0.0002)  # after the linger: the watch asleep, woken by the batch
def test_for_a_batch_at_any_moment_the_first_look_due_wakes_a_thread_while_the_process_idles(
    arrival, late
):
    """FAILS on 37c60ce. The process idle but for the watch, one thread blocked in a task and
    one task behind it: whenever the batch comes (while the watch lingers, as it goes to
    sleep, or after) and however late each wait of the watch ends, a thread is woken for the
    task STALL_AFTER after the batch, plus those waits' lateness (one to notice the batch,
    one for the STALL_AFTER), as the watch before 37c60ce did.

    The watch now judges the process busy at any look that follows a lingering poll: it
    takes the CPU time between the poll's end and the look (the watch's own microseconds)
    over that same span. A batch that has waited STALL_AFTER by then then waits another.
    """
    woken = first_wake_after(arrival, late)
    assert woken is not None
    assert woken <= STALL_AFTER + 2 * late + 0.0001, (
        f"a task waited {woken * 1000:.3f} ms for a thread while three slept"
    )


def test_a_batch_as_the_lingering_watch_looks_gets_its_thread_at_the_first_look_due(
    monkeypatch,
):
    """FAILS on 37c60ce, with real threads. A batch of a blocking task and a quick one comes
    while the watch lingers; its poll ends once the quick task has waited STALL_AFTER (the
    batch came as the poll began, or the watch got the CPU back a moment late: here it is
    held until then). The process is idle (one thread waits on an event, three sleep), so
    that look must wake a thread for the quick task; it judges the process busy over the
    microseconds since the poll and wakes none, and the task waits another STALL_AFTER."""
    monkeypatch.setattr(pool_module, "WATCH_LINGER", 30.0)  # it lingers all through
    pool = HandlerPool(4)
    events: list[str] = []
    real_wait = pool._stalls.wait
    real_wake = pool._wake_locked

    def wait(timeout: float | None = None) -> bool:
        lingering = timeout is not None and not pool._tasks
        events.append("poll" if lingering else "wait")
        result = real_wait(timeout)
        if lingering and pool._tasks:  # a batch came during this poll
            while time.monotonic() - pool._taken_at < STALL_AFTER:
                time.sleep(0.0005)
            events.append("late look")
        return result

    def wake(count: int) -> None:
        if threading.current_thread() is pool._watch:
            events.append("wake")
        real_wake(count)

    pool._stalls.wait = wait  # type: ignore[method-assign]
    pool._wake_locked = wake  # type: ignore[method-assign]
    missed = []
    try:
        for _ in range(3):
            del events[:]
            wait_for(lambda: events and events[-1] == "poll", what="the watch polling")
            release = threading.Event()
            quick: list[int] = []
            pool.submit_many([lambda r=release: r.wait(10), lambda q=quick: q.append(1)], wake=1)
            wait_for(lambda q=quick: q, what="the quick task run")
            release.set()
            wait_for(lambda: pool.busy == 0 and not pool._tasks, what="the pool idle")
            assert "late look" in events, events
            after = events[events.index("late look") + 1 :]
            if not after or after[0] != "wake":
                missed.append(after[:3])
    finally:
        assert pool.shutdown(timeout=5)
    assert not missed, f"looks due that woke no thread (process idle): {missed}"


# -- the stall watch with real threads: the pool's guarantee, idling, shutdown ---------------------


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(size=st.integers(2, 5), data=st.data())
def test_no_task_waits_for_a_busy_thread_while_one_sleeps_whenever_its_batch_comes(
    size, data, monkeypatch
):
    """Batches that come while the watch lingers, as it goes to sleep or while it sleeps
    (the linger made 20 ms, pauses around it), any mix, any number woken: with fewer
    blocking tasks than threads, every quick task finishes while they block."""
    monkeypatch.setattr(pool_module, "WATCH_LINGER", 0.02)
    batches = draw_batches(data, size, st.integers(1, 4), max_tasks=6)
    pauses = [
        data.draw(st.sampled_from([0.0, 0.004, 0.012, 0.019, 0.021, 0.035]), label="pause")
        for _ in batches
    ]
    pool = HandlerPool(size)
    try:
        run_batches(pool, batches, pauses)
        assert pool.alive == size
    finally:
        assert pool.shutdown(timeout=5)


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def count_watch_waits(pool: HandlerPool) -> list[float | None]:
    """The timeouts of the watch's waits from now on (the one it is in is not counted)."""
    waits: list[float | None] = []
    real_wait = pool._stalls.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return real_wait(timeout)

    pool._stalls.wait = wait  # type: ignore[method-assign]
    return waits


def test_an_idle_pools_watch_sleeps_until_woken_not_polling():
    """After some batches and WATCH_LINGER, the watch of an idle pool sleeps: over a second
    it neither wakes nor uses the CPU (a watch spinning or polling would do both)."""
    pool = HandlerPool(4)
    try:
        for _ in range(5):
            done: list[int] = []
            pool.submit_many([lambda d=done: d.append(1)] * 3, wake=1)
            wait_for(lambda d=done: len(d) == 3, what="the batch done")
        wait_for(lambda: pool._watch_idle, what="the watch asleep until woken")
        waits = count_watch_waits(pool)
        cpu = thread_cpu(pool._watch)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # an idle second, watched
            time.sleep(0.05)
            assert pool._watch_idle
        assert thread_cpu(pool._watch) - cpu < 0.002
        assert waits == []
    finally:
        assert pool.shutdown(timeout=5)


def test_a_watch_with_every_thread_busy_and_tasks_waiting_goes_to_sleep_too():
    """Every thread held by a long task, tasks queued behind them (a prefetching worker's
    usual state): no thread to wake, so after WATCH_LINGER the watch sleeps, as it did at
    once before; and a thread that finishes still takes the next task."""
    pool = HandlerPool(2)
    release = threading.Event()
    done: list[int] = []
    try:
        pool.submit_many([lambda: release.wait(10)] * 2 + [lambda: done.append(1)] * 3)
        wait_for(lambda: pool.busy == 2, what="both threads held")
        wait_for(lambda: pool._watch_idle, what="the watch asleep", timeout=2)
        waits = count_watch_waits(pool)
        cpu = thread_cpu(pool._watch)
        time.sleep(0.3)  # a stretch of a saturated pool, watched
        assert thread_cpu(pool._watch) - cpu < 0.002
        assert waits == []
        assert not done
        release.set()
        wait_for(lambda: len(done) == 3, what="the queued tasks run")
    finally:
        release.set()
        assert pool.shutdown(timeout=5)


@pytest.mark.parametrize("state", ["lingering", "asleep", "saturated"])
def test_shutdown_ends_the_watch_and_threads_at_once_whatever_the_watch_does(state, monkeypatch):
    """Shutdown while the watch polls (lingering), sleeps until woken, or while every thread
    was held and tasks waited behind them (released as shutdown begins): the threads exit,
    the watch with them, at once."""
    if state == "lingering":
        monkeypatch.setattr(pool_module, "WATCH_LINGER", 30.0)
    pool = HandlerPool(3)
    release = threading.Event()
    done: list[int] = []
    try:
        if state == "asleep":
            wait_for(lambda: pool._watch_idle, what="the watch asleep")
        elif state == "saturated":
            pool.submit_many([lambda: release.wait(10)] * 3 + [lambda: done.append(1)] * 4)
            wait_for(lambda: pool.busy == 3, what="every thread held")
        else:
            pool.submit_many([lambda: done.append(1)])
            wait_for(lambda: done, what="the task run")
            assert not pool._watch_idle
    finally:
        release.set()
        began = time.monotonic()
        assert pool.shutdown(timeout=5)
        took = time.monotonic() - began
    pool._watch.join(2)
    assert not pool._watch.is_alive()
    assert took < 1.0, took
    assert len(done) == (4 if state == "saturated" else 1 if state == "lingering" else 0)


# -- the CPU clock read once per interval: _execute on its own ------------------------------------


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
        wait_for(lambda: len(seen) == 2, what="two jobs finished")
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
                wait_for(lambda: pool.busy == 0 and not pool._tasks, what="the thread free")
                time.sleep(pause)  # the thread asleep between tasks: not a wait for anything
            if kind == "step":
                pool.submit(lambda: (burn(0.006), steps.append(1)))
            else:
                running = fake_running(work[kind])
                pool.submit(lambda running=running: worker.executor.run_on_thread(running))
                jobs += 1
        wait_for(lambda: len(seen) == jobs and pool.busy == 0, what="every task run")
    finally:
        assert pool.shutdown(timeout=5)
    for ran, held in seen:
        assert ran is not None
        assert held is None or held <= ran + 0.001, seen
    if seen:
        assert seen[0][1] is not None, seen  # the thread's first job
        assert worker.slots.times.mean is not None
    for (ran, _), (_, held_next) in itertools.pairwise(seen):
        if ran >= 0.003:
            assert held_next is not None, seen


# -- the CPU clock read once per interval: workers on PostgreSQL ---------------------------------


class Nap(Payload, name="test.round24.nap.v1"):
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


@pytest.mark.django_db(transaction=True)
def test_prefetch_goes_by_every_jobs_run_time_measured_or_not(monkeypatch):
    """With the interval made a minute, only each thread's first job is measured; prefetch's
    mean run time still takes every job: short handlers get prefetch, and once handlers run
    50 ms it is gone (the worker holds no job beyond its threads)."""
    monkeypatch.setattr(handoff, "CPU_SAMPLE_INTERVAL", 60.0)
    worker = Worker(
        Registry([JobType(Step, sync_step, Policy(concurrency=None))]),
        WorkerConfig(install_signal_handlers=False, concurrency=2, poll_interval=0.05, prefetch=20),
    )
    for _ in range(80):
        enqueue(Step(plan=("ok",)), priority=10)
    for _ in range(16):
        enqueue(Step(plan=("sleep",), seconds=0.05))
    capacities: list[tuple[int, int]] = []  # (capacity, jobs succeeded) after each pass

    def until(w: Worker) -> bool:
        with w.slots.lock:
            capacity = w.slots.capacity()
        capacities.append((capacity, Job.objects.filter(state="succeeded").count()))
        return w.idle and all_done()

    worker.run(until=until)
    assert len(worker.slots.times.recent) <= 2  # each thread's first job only
    assert max(c for c, done in capacities if done < 80) > 2  # short handlers: prefetched
    with worker.slots.lock:
        assert worker.slots.capacity() == 2, worker.slots.times.mean  # long ones: no prefetch


@pytest.mark.django_db(transaction=True)
def test_a_drain_of_a_prefetching_worker_leaks_no_slot():
    """A worker prefetching short handlers is stopped mid-drain: it stops within its
    shutdown timeout, every job it held is done or handed back (none left running), and it
    holds no slot and counts no handler running."""
    jobs = [enqueue(Step(plan=("sleep",), seconds=0.002)) for _ in range(300)]
    registry = Registry([JobType(Step, sync_step, Policy(concurrency=None))])
    with running_worker(registry, concurrency=4, prefetch=40) as worker:
        wait_for(lambda: Job.objects.filter(state="succeeded").count() >= 30, what="a drain begun")
        began = time.monotonic()  # leaving stops it (one request: a graceful drain)
    assert time.monotonic() - began < 5
    states = set(Job.objects.filter(pk__in=[j.id for j in jobs]).values_list("state", flat=True))
    assert states <= {"succeeded", "queued"}, states
    assert worker.slots.in_flight == 0 and worker.handlers_running == 0
    assert worker.idle


@pytest.mark.django_db(transaction=True)
def test_an_idle_workers_watch_sleeps_through_an_idle_second():
    """A worker that has run a few jobs and then idles (its loop still polls the database):
    its pool's watch sleeps once WATCH_LINGER is over, and over an idle second it uses next
    to no CPU and never wakes."""
    registry = Registry([JobType(Step, sync_step, Policy(concurrency=None))])
    for _ in range(20):
        enqueue(Step(plan=("ok",)))
    with running_worker(registry, concurrency=4) as worker:
        wait_for(lambda: all_done() and worker.idle, what="the jobs done")
        pool = wait_for(lambda: getattr(worker.executor, "pool", None), what="the pool")
        wait_for(lambda: pool._watch_idle, what="the watch asleep", timeout=5)
        waits = count_watch_waits(pool)
        cpu = thread_cpu(pool._watch)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # an idle second, watched
            time.sleep(0.05)
        assert thread_cpu(pool._watch) - cpu < 0.002
        assert waits == []
