"""The handler pool's stall watch: no task waits for a busy thread while one sleeps, and an
idle pool's watch sleeps instead of polling.

The watch keeps looking every ``STALL_AFTER`` for ``WATCH_LINGER`` after it was last woken or
found tasks waiting, then sleeps until a batch wakes it. Checked here: the pool's guarantee
across batches that come while the watch lingers, as it goes to sleep and after; a stall
still seen ``STALL_AFTER`` after the batch when a look follows a lingering poll (the CPU share
is measured over the lingering wait itself, not over the microseconds since the poll, in
which only the watch ran); an idle pool's and an idle worker's watch asleep, not polling;
shutdown from either state.

Pool tests drive ``HandlerPool`` directly, on a simulated clock or with real threads; the
worker test runs a real ``Worker`` on PostgreSQL. Waits poll with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import pool as pool_module
from jobs.worker.pool import STALL_AFTER, HandlerPool
from tests.support.handler_pool import draw_batches, run_batches
from tests.support.polling import wait_for
from tests.support.worker import Step, running_worker

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
    """The process idle but for the watch, one thread blocked in a task and one task behind
    it: whenever the batch comes (while the watch lingers, as it goes to sleep, or after) and
    however late each wait of the watch ends, a thread is woken for the task STALL_AFTER after
    the batch, plus those waits' lateness (one to notice the batch, one for the STALL_AFTER).

    A look that follows a lingering poll must not judge the process busy from the CPU time
    between the poll's end and the look (the watch's own microseconds) over that same span:
    a batch that has waited STALL_AFTER by then would wait another.
    """
    woken = first_wake_after(arrival, late)
    assert woken is not None
    assert woken <= STALL_AFTER + 2 * late + 0.0001, (
        f"a task waited {woken * 1000:.3f} ms for a thread while three slept"
    )


def test_a_batch_as_the_lingering_watch_looks_gets_its_thread_at_the_first_look_due(
    monkeypatch,
):
    """With real threads: a batch of a blocking task and a quick one comes while the watch
    lingers; its poll ends once the quick task has waited STALL_AFTER (the batch came as the
    poll began, or the watch got the CPU back a moment late: here it is held until then). The
    process is idle (one thread waits on an event, three sleep), so that look wakes a thread
    for the quick task rather than judge the process busy over the microseconds since the
    poll and leave the task to wait another STALL_AFTER."""
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
            wait_for(
                lambda: events and events[-1] == "poll", what="the watch polling", interval=0.005
            )
            release = threading.Event()
            quick: list[int] = []
            pool.submit_many([lambda r=release: r.wait(10), lambda q=quick: q.append(1)], wake=1)
            wait_for(lambda q=quick: q, what="the quick task run", interval=0.005)
            release.set()
            wait_for(
                lambda: pool.busy == 0 and not pool._tasks, what="the pool idle", interval=0.005
            )
            assert "late look" in events, events
            after = events[events.index("late look") + 1 :]
            if not after or after[0] != "wake":
                missed.append(after[:3])
    finally:
        assert pool.shutdown(timeout=5)
    assert not missed, f"looks due that woke no thread (process idle): {missed}"


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
            wait_for(lambda d=done: len(d) == 3, what="the batch done", interval=0.005)
        wait_for(lambda: pool._watch_idle, what="the watch asleep until woken", interval=0.005)
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
        wait_for(lambda: pool.busy == 2, what="both threads held", interval=0.005)
        wait_for(lambda: pool._watch_idle, what="the watch asleep", timeout=2, interval=0.005)
        waits = count_watch_waits(pool)
        cpu = thread_cpu(pool._watch)
        time.sleep(0.3)  # a stretch of a saturated pool, watched
        assert thread_cpu(pool._watch) - cpu < 0.002
        assert waits == []
        assert not done
        release.set()
        wait_for(lambda: len(done) == 3, what="the queued tasks run", interval=0.005)
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
            wait_for(lambda: pool._watch_idle, what="the watch asleep", interval=0.005)
        elif state == "saturated":
            pool.submit_many([lambda: release.wait(10)] * 3 + [lambda: done.append(1)] * 4)
            wait_for(lambda: pool.busy == 3, what="every thread held", interval=0.005)
        else:
            pool.submit_many([lambda: done.append(1)])
            wait_for(lambda: done, what="the task run", interval=0.005)
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


def sync_step(payload: Step, ctx) -> None:
    if payload.seconds:
        time.sleep(payload.seconds)


def all_done() -> bool:
    return not Job.objects.exclude(state="succeeded").exists()


@pytest.mark.django_db(transaction=True)
def test_an_idle_workers_watch_sleeps_through_an_idle_second():
    """A worker that has run a few jobs and then idles (its loop still polls the database):
    its pool's watch sleeps once WATCH_LINGER is over, and over an idle second it uses next
    to no CPU and never wakes."""
    registry = Registry([JobType(Step, sync_step, Policy(concurrency=None))])
    for _ in range(20):
        enqueue(Step(plan=("ok",)))
    with running_worker(registry, concurrency=4) as worker:
        wait_for(lambda: all_done() and worker.idle, what="the jobs done", interval=0.005)
        pool = wait_for(
            lambda: getattr(worker.executor, "pool", None), what="the pool", interval=0.005
        )
        wait_for(lambda: pool._watch_idle, what="the watch asleep", timeout=5, interval=0.005)
        waits = count_watch_waits(pool)
        cpu = thread_cpu(pool._watch)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # an idle second, watched
            time.sleep(0.05)
        assert thread_cpu(pool._watch) - cpu < 0.002
        assert waits == []
