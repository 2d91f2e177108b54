"""Prefetch: a worker holds jobs beyond its handler threads only while its handlers run short.

A held job is a ``running`` row claimed by the worker; a started one is a handler entry the
recorder saw. The worker runs in a thread of this process against the test database; the
tests read what it holds from the database, polling with a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import REGISTRY

from jobs import enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.queue import ClaimedJob
from jobs.worker import handoff
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, make_context
from jobs.worker.handoff import PREFETCH_HORIZON
from jobs.worker.runner import Worker
from tests.support.polling import wait_for
from tests.support.worker import (
    Echo,
    Recorder,
    Step,
    registry,
    running_worker,
    scripted,
)

pytestmark = pytest.mark.django_db(transaction=True)

STEP = "test.step.v1"


def held_by(worker: Worker) -> int:
    return Job.objects.filter(state="running", claimed_by=worker.config.identity).count()


def succeeded(jobs) -> bool:
    return Job.objects.filter(pk__in=[j.id for j in jobs], state="succeeded").count() == len(jobs)


def start(recorder: Recorder, **config) -> tuple[Worker, threading.Thread]:
    worker = Worker(
        registry(recorder, concurrency=None),
        WorkerConfig(install_signal_handlers=False, poll_interval=0.05, **config),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    return worker, thread


def stop(worker: Worker, thread: threading.Thread) -> None:
    worker.request_stop()
    thread.join(20)
    assert not thread.is_alive()


def running_gauge() -> float:
    return REGISTRY.get_sample_value("jobs_worker_running")


def most_held(worker: Worker, load) -> int:
    """Wait until ``load`` succeeded (20 s at most); the most jobs the worker held meanwhile."""
    most = 0
    deadline = time.monotonic() + 20
    while not succeeded(load):
        assert time.monotonic() < deadline, "the load did not drain within 20 s"
        most = max(most, held_by(worker))
        time.sleep(0.005)
    return most


def measured_short(worker: Worker) -> None:
    """Run one no-op job, so the worker knows its handlers are short."""
    first = enqueue(Step(plan=("ok",)))
    wait_for(lambda: succeeded([first]), what="the first job ran", interval=0.005)


def test_short_handlers_are_prefetched_but_never_run_beyond_the_threads():
    recorder = Recorder()
    worker, thread = start(recorder, concurrency=2, prefetch=6)
    try:
        measured_short(worker)
        before = running_gauge()
        # Each takes 0.3 s: a claim takes 2 for the threads and 6 to wait for them.
        load = [enqueue(Step(plan=("sleep",), seconds=0.3)) for _ in range(10)]
        wait_for(
            lambda: held_by(worker) == 8, what="8 jobs held by a 2-thread worker", interval=0.005
        )
        assert running_gauge() - before <= 2  # jobs_worker_running counts handlers, not held
        wait_for(lambda: succeeded(load), timeout=20, what="every job succeeded", interval=0.005)
    finally:
        stop(worker, thread)
    assert running_gauge() == before
    assert recorder.peak[STEP] == 2  # handlers at once: never more than the threads
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}


def test_long_handlers_get_no_prefetch():
    # A 0.2 s handler on 2 threads finishes 2 jobs in 0.2 s: far fewer than one in the
    # prefetch horizon, so the worker holds no job beyond its threads.
    assert 2 * PREFETCH_HORIZON / 0.2 < 1
    recorder = Recorder()
    worker, thread = start(recorder, concurrency=2, prefetch=6)
    try:
        load = [enqueue(Step(plan=("sleep",), seconds=0.2)) for _ in range(8)]
        most = most_held(worker, load)
    finally:
        stop(worker, thread)
    assert most == 2


@pytest.mark.parametrize("own_limit", [None, 4])  # a type's own limit above the threads too
def test_a_type_under_a_fleet_wide_limit_is_not_prefetched(own_limit):
    # A held job counts against the limit from its claim: held in front of the threads it
    # would take a place in the fleet without running.
    recorder = Recorder()
    worker = Worker(
        registry(recorder, concurrency=own_limit, global_concurrency=50),
        WorkerConfig(install_signal_handlers=False, poll_interval=0.05, concurrency=2, prefetch=6),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        measured_short(worker)
        load = [enqueue(Step(plan=("sleep",), seconds=0.1)) for _ in range(8)]
        most = most_held(worker, load)
    finally:
        stop(worker, thread)
    assert most == 2


def async_worker(recorder: Recorder, **config) -> tuple[Worker, threading.Thread]:
    """A worker of the scripted thread-run type and an ``async def`` one (Echo: its text is
    the seconds it waits), recording the async handlers' entries too."""

    async def wait(payload: Echo, ctx) -> None:
        recorder.enter(payload, ctx)
        try:
            await asyncio.sleep(float(payload.text))
        finally:
            recorder.leave(ctx)

    types = Registry([JobType(Step, scripted(recorder), Policy()), JobType(Echo, wait, Policy())])
    worker = Worker(
        types, WorkerConfig(install_signal_handlers=False, poll_interval=0.05, **config)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    return worker, thread


def test_async_handlers_are_prefetched_but_never_run_beyond_the_concurrency():
    """Held in front of the slots, an async job starts as soon as another one ends: the slot
    does not wait for the pass that writes the outcome and claims the next job."""
    recorder = Recorder()
    worker, thread = async_worker(recorder, concurrency=2, prefetch=6)
    try:
        first = enqueue(Echo(text="0"))
        wait_for(lambda: succeeded([first]), what="a short async job ran", interval=0.005)
        load = [enqueue(Echo(text="0.3")) for _ in range(10)]
        wait_for(
            lambda: held_by(worker) == 8, what="8 jobs held by a worker of 2 slots", interval=0.005
        )
        wait_for(lambda: succeeded(load), timeout=20, what="every job succeeded", interval=0.005)
    finally:
        stop(worker, thread)
    assert recorder.peak["test.echo.v1"] == 2  # handlers at once: never more than the slots
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}


def test_prefetched_handlers_of_both_kinds_never_run_beyond_the_concurrency():
    """Thread-run jobs held in front of the threads started as threads freed up, whatever
    async handlers ran meanwhile: prefetch ran 4 handlers at once on ``--concurrency 3``. A
    held job now starts only into a free slot, and waits for one otherwise."""
    recorder = Recorder()
    worker, thread = async_worker(recorder, concurrency=3, prefetch=9)
    try:
        warm = [enqueue(Echo(text="0")), enqueue(Step(plan=("ok",)))]
        wait_for(lambda: succeeded(warm), what="short jobs of both kinds ran", interval=0.005)
        load = [
            enqueue(Echo(text="0.2")) if n % 2 else enqueue(Step(plan=("sleep",), seconds=0.2))
            for n in range(16)
        ]
        most = held = 0
        deadline = time.monotonic() + 20
        while not succeeded(load):
            assert time.monotonic() < deadline, "the load did not drain within 20 s"
            with recorder.lock:
                most = max(most, sum(recorder.active.values()))
            held = max(held, held_by(worker))
            time.sleep(0.002)
    finally:
        stop(worker, thread)
    assert most <= 3  # handlers of both kinds at once: never more than the concurrency
    assert recorder.peak["test.echo.v1"] >= 1 and recorder.peak[STEP] >= 1
    assert held > 3  # prefetched: held beyond the slots


def thread_run(seconds: float) -> Step:
    return Step(plan=("sleep",), seconds=seconds) if seconds else Step(plan=("ok",))


def run_async(seconds: float) -> Echo:
    return Echo(text=str(seconds))  # async_worker's Echo handler waits that long


@pytest.mark.parametrize(
    "worker_of, job", [(start, thread_run), (async_worker, run_async)], ids=["thread", "async"]
)
def test_a_drain_hands_prefetched_jobs_back_at_once(worker_of, job):
    recorder = Recorder()
    worker, thread = worker_of(recorder, concurrency=1, prefetch=5)
    try:
        first = enqueue(job(0))
        wait_for(lambda: succeeded([first]), what="a short job ran", interval=0.005)
        long = enqueue(job(1.5))  # claimed first: the older job
        waiting = [enqueue(job(0)) for _ in range(4)]
        wait_for(
            lambda: held_by(worker) == 5, what="the long job and 4 prefetched held", interval=0.005
        )
        wait_for(lambda: len(recorder.calls) == 2, what="the long job started", interval=0.005)
        worker.request_stop()
        # Back in the queue, unrun, while the long job still runs: not after the drain.
        wait_for(
            lambda: (
                Job.objects.filter(
                    pk__in=[j.id for j in waiting], state="queued", attempts=0, claim_token=None
                ).count()
                == 4
            ),
            what="the prefetched jobs handed back",
            interval=0.005,
        )
        assert Job.objects.get(pk=long.id).state == "running"
    finally:
        thread.join(20)
    assert not thread.is_alive()
    assert Job.objects.get(pk=long.id).state == "succeeded"
    assert len(recorder.calls) == 2  # the handed-back jobs never ran here


def test_prefetch_is_off_by_default_and_checked():
    # Off, a worker claims at most its free threads however short its handlers run.
    recorder = Recorder()
    worker, thread = start(recorder, concurrency=2)
    try:
        measured_short(worker)
        load = [enqueue(Step(plan=("sleep",), seconds=0.05)) for _ in range(8)]
        most = most_held(worker, load)
    finally:
        stop(worker, thread)
    assert most == 2
    with pytest.raises(ImproperlyConfigured, match="prefetch must be from 0 to 10000, got -1"):
        WorkerConfig(prefetch=-1)


def test_async_jobs_waiting_for_a_slot_end_in_turn_when_the_loop_is_gone():
    """The loop gone (a bug of ours), each waiting async job ends as the worker's failure,
    and each end resumes the next: in turn, not one call deeper each (3,000 jobs waiting
    went past Python's recursion limit)."""
    recorder = Recorder()

    async def wait(payload: Echo, ctx) -> None:
        await asyncio.sleep(0)

    echo = JobType(Echo, wait, Policy())
    worker = Worker(
        Registry([JobType(Step, scripted(recorder), Policy()), echo]),
        WorkerConfig(install_signal_handlers=False, concurrency=1, prefetch=5000),
    )

    class GoneLoop:
        def call_soon_threadsafe(self, *args):
            raise RuntimeError("Event loop is closed")

    worker.executor.pool = type("Pool", (), {"event_loop": type("L", (), {"loop": GoneLoop()})()})()
    token = uuid.uuid4()
    waiting = [
        Running(
            ClaimedJob(n, f"j{n}", echo.name, {"text": "0"}, "", "default", 0, 1, 3, token, 0.0),
            echo,
            make_context(
                ClaimedJob(n, f"j{n}", echo.name, {}, "", "default", 0, 1, 3, token, 0.0), echo
            ),
        )
        for n in range(3_001)
    ]
    running, *rest = waiting
    with worker.slots.lock:
        worker.slots.in_flight = len(waiting)
        worker.slots.by_name[echo.name] = len(waiting)
        assert worker.slots.take(running)
        for job in rest:
            assert not worker.slots.take(job)

    worker.executor.finished(running, None)

    assert worker.slots.in_flight == 0 and worker.handlers_running == 0 and not worker.slots.waiting
    failed = [outcome for _, outcome in worker.completer.acks if outcome is not None]
    assert len(failed) == len(rest)
    assert {o.code for o in failed} == {"handler_error"}


def sync_step(payload: Step, ctx) -> None:
    if payload.seconds:
        time.sleep(payload.seconds)


def all_done() -> bool:
    return not Job.objects.exclude(state="succeeded").exists()


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
        wait_for(
            lambda: Job.objects.filter(state="succeeded").count() >= 30,
            what="a drain begun",
            interval=0.005,
        )
        began = time.monotonic()  # leaving stops it (one request: a graceful drain)
    assert time.monotonic() - began < 5
    states = set(Job.objects.filter(pk__in=[j.id for j in jobs]).values_list("state", flat=True))
    assert states <= {"succeeded", "queued"}, states
    assert worker.slots.in_flight == 0 and worker.handlers_running == 0
    assert worker.idle
