"""An async job awaits its handler's task directly: what a cancellation of either task does.

Awaited directly, a cancellation of the worker's own task for the job (the loop closing under
it, or anything else cancelling it) is passed on to the handler's task; ``_call`` raises it
again when its own task has a cancellation pending, so the job still ends as the worker's
failure whatever the handler does with that cancellation: return a value, raise something
else, re-raise it through ``asyncio.timeout()`` or a ``TaskGroup``. The handler's task is
never left running behind a job already ended: it is cancelled with it, and the job keeps
its slot until the handler has returned.

The paths that cancel only the handler's task (deadline, lost lease, drain, operator cancel)
and what a handler does to its own task end as they do for any handler. Real workers, real
PostgreSQL; waits poll with a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest

from jobs import JobContext, Payload, RetryAfter, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.worker import on_loop
from jobs.worker.runner import Worker
from tests.support.polling import wait_for
from tests.support.worker import FAST_BACKOFF, run_jobs, worker_config

pytestmark = pytest.mark.django_db(transaction=True)

WORKER_FAILURE = "the worker failed running the job: CancelledError"
STOLEN = "00000000-0000-0000-0000-000000000023"


class Act(Payload, name="test.async.cancellation.v1"):
    action: str = "ok"


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = 0
        self.cancelled = 0  # cancellations the handlers caught
        self.loop: asyncio.AbstractEventLoop | None = None
        self.contexts: dict[int, list[JobContext]] = {}
        self.children: list[asyncio.Task] = []
        self.release = threading.Event()  # ends a handler that ignores its cancellation

    def saw_cancel(self) -> None:
        with self.lock:
            self.cancelled += 1


def handler(seen: Seen):
    async def handle(payload: Act, ctx: JobContext):
        with seen.lock:
            seen.started += 1
            seen.loop = asyncio.get_running_loop()
            seen.contexts.setdefault(ctx.id, []).append(ctx)
        action = payload.action
        if action.startswith("await-"):
            return await _await_then(seen, action.removeprefix("await-"))
        if action == "cancel-worker-then-return":  # its worker's task, cancelled as it returns
            [mine] = [t for t in asyncio.all_tasks() if t.get_name() == _worker_name(ctx)]
            asyncio.get_running_loop().call_soon(mine.cancel)
            return "returned"
        if action == "self-cancel-return":  # a cancel pending as the coroutine returns
            asyncio.current_task().cancel()
            return "never seen"
        if action == "self-cancel-uncancel":
            asyncio.current_task().cancel()
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()
            return "recovered"
        if action == "inner-timeout":
            async with asyncio.timeout(0.01):
                await asyncio.sleep(30)
        if action == "taskgroup-error":
            async with asyncio.TaskGroup() as tg:
                seen.children.append(tg.create_task(asyncio.sleep(30)))
                tg.create_task(_fail_soon())
        if action == "generator-exit":
            raise GeneratorExit
        if action == "retry-after-then-ok" and ctx.attempt == 1:
            raise RetryAfter(30)  # waited out in process (under RETRY_IN_PROCESS_UP_TO)
        return "ok"

    return handle


async def _await_then(seen: Seen, reaction: str):
    """Await for long; on the cancellation, react as ``reaction`` says."""
    try:
        if reaction == "timeout-scope":
            async with asyncio.timeout(30):
                await asyncio.sleep(30)
        elif reaction == "taskgroup":
            async with asyncio.TaskGroup() as tg:
                seen.children.extend(tg.create_task(asyncio.sleep(30)) for _ in range(2))
        else:
            await asyncio.sleep(30)
    except asyncio.CancelledError:
        seen.saw_cancel()
        if reaction == "return":
            return "swallowed"
        if reaction == "value-error":
            raise ValueError("raised instead of the cancellation") from None
        if reaction == "keyboard-interrupt":
            raise KeyboardInterrupt from None
        if reaction == "ignore":
            while not seen.release.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    seen.saw_cancel()
            return "ignored"
        raise
    return "slept"


async def _fail_soon() -> None:
    await asyncio.sleep(0.01)
    raise ConnectionError("a child failed")


def _worker_name(ctx: JobContext) -> str:
    return f"worker of job {ctx.job_id}"


def registry(seen: Seen, **policy) -> Registry:
    options = {"timeout": timedelta(seconds=10), "max_attempts": 1, "backoff": FAST_BACKOFF}
    return Registry([JobType(Act, handler(seen), Policy(**{**options, **policy}))])


def row(job) -> Job:
    return Job.objects.get(pk=job.id)


class Running:
    """A worker on a thread of its own, stopped (and the handlers released) on exit."""

    def __init__(self, seen: Seen, worker: Worker) -> None:
        self.seen, self.worker = seen, worker
        self.thread = threading.Thread(target=worker.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.seen.release.set()
        self.worker.request_stop()
        self.thread.join(15)
        assert not self.thread.is_alive(), "the worker did not stop"

    def cancel_worker_task(self, job) -> None:
        """Cancel the worker's own task for ``job`` on the loop, as the loop's close does."""
        [ctx] = self.seen.contexts[job.id]
        loop = self.seen.loop
        assert loop is not None
        found: list[asyncio.Task] = []
        done = threading.Event()

        def cancel() -> None:
            found.extend(t for t in asyncio.all_tasks(loop) if t.get_name() == _worker_name(ctx))
            for task in found:
                task.cancel()
            done.set()

        loop.call_soon_threadsafe(cancel)
        assert done.wait(5) and len(found) == 1, found


@pytest.fixture
def seen():
    seen = Seen()
    yield seen
    seen.release.set()


# -- the worker's own task cancelled -------------------------------------------------------


@pytest.mark.parametrize(
    "reaction",
    ["reraise", "return", "value-error", "keyboard-interrupt", "timeout-scope", "taskgroup"],
)
def test_the_worker_task_cancelled_mid_await_is_the_workers_failure_whatever_the_handler_does(
    seen, reaction
):
    """Whatever the handler makes of the cancellation passed on to it (return a value, raise
    something else, re-raise it through a timeout scope or a TaskGroup), the job ends as the
    worker's failure, not as the handler's result or error; the handler's task (and a
    TaskGroup's children) end with it, and the slot comes back."""
    job = enqueue(Act(action=f"await-{reaction}"))
    with Running(seen, Worker(registry(seen), worker_config())) as running:
        wait_for(lambda: seen.started == 1, interval=0.005)
        running.cancel_worker_task(job)
        wait_for(lambda: row(job).state == "failed", interval=0.005)
        wait_for(
            lambda: running.worker.idle and running.worker.slots.in_flight == 0, interval=0.005
        )
    failed = row(job)
    assert (failed.attempts, failed.last_error) == (1, "handler_error")
    assert failed.error_detail.startswith(WORKER_FAILURE), failed.error_detail
    assert (
        "ValueError" not in failed.error_detail and "KeyboardInterrupt" not in failed.error_detail
    )
    assert failed.result is None
    assert seen.cancelled == 1, "the handler's task is cancelled with the job's"
    assert all(child.cancelled() for child in seen.children)


def test_the_worker_task_cancelled_as_the_handler_returns_is_the_workers_failure(seen):
    """Cancelled after the handler's task ended but before the job's task resumed: the
    result is not taken, the job ends as the worker's failure (as under asyncio.wait)."""
    job = enqueue(Act(action="cancel-worker-then-return"))

    worker = run_jobs(registry(seen), job.id)

    failed = row(job)
    assert (failed.state, failed.last_error, failed.result) == ("failed", "handler_error", None)
    assert failed.error_detail.startswith(WORKER_FAILURE), failed.error_detail
    assert worker.idle and worker.slots.in_flight == 0


def test_the_worker_task_cancelled_before_the_handlers_first_step(seen, monkeypatch):
    """A cancellation pending on the job's task as it starts the handler's: the handler's
    task is cancelled before it runs (it never starts) and the job is the worker's failure."""
    real_start = on_loop._Current.start

    def start_then_cancel_the_job_task(current, coro, name):
        task = real_start(current, coro, name)
        asyncio.current_task().cancel()
        return task

    monkeypatch.setattr(on_loop._Current, "start", start_then_cancel_the_job_task)
    job = enqueue(Act())

    worker = run_jobs(registry(seen), job.id)

    failed = row(job)
    assert (failed.state, failed.last_error) == ("failed", "handler_error")
    assert failed.error_detail.startswith(WORKER_FAILURE), failed.error_detail
    assert seen.started == 0, "the handler's task was cancelled before its first step"
    assert worker.idle and worker.slots.in_flight == 0


def test_a_handler_ignoring_the_worker_tasks_cancellation_keeps_its_slot_until_it_returns(seen):
    """The job's task waits for the handler's now: the slot is held (and nothing written)
    while the handler still runs, then the job ends as the worker's failure. Under
    asyncio.wait the failure was written at once, the handler left running with no slot."""
    job = enqueue(Act(action="await-ignore"))
    with Running(seen, Worker(registry(seen), worker_config())) as running:
        wait_for(lambda: seen.started == 1, interval=0.005)
        running.cancel_worker_task(job)
        wait_for(lambda: seen.cancelled == 1, interval=0.005)
        assert running.worker.slots.in_flight == 1 and not running.worker.idle
        assert row(job).state == "running"
        seen.release.set()
        wait_for(lambda: row(job).state == "failed", interval=0.005)
        wait_for(
            lambda: running.worker.idle and running.worker.slots.in_flight == 0, interval=0.005
        )
    assert row(job).error_detail.startswith(WORKER_FAILURE), row(job).error_detail


def test_the_worker_task_cancelled_during_an_in_process_retry_wait(seen):
    """The wait of a short RetryAfter is still awaited through asyncio.wait: cancelling the
    job's task there ends the attempt as the worker's failure, a retry through the queue
    (a new claim), not a continuation in process."""
    job = enqueue(Act(action="retry-after-then-ok"))
    with Running(seen, Worker(registry(seen, max_attempts=2), worker_config())) as running:
        wait_for(lambda: seen.started == 1, interval=0.005)
        loop = seen.loop
        assert loop is not None

        def waiting() -> bool:
            names = asyncio.run_coroutine_threadsafe(_task_names(), loop).result(5)
            return any(name.endswith("waits to retry") for name in names)

        wait_for(waiting, interval=0.005)
        running.cancel_worker_task(job)
        wait_for(lambda: row(job).state == "succeeded", interval=0.005)
        wait_for(lambda: running.worker.idle, interval=0.005)
    first, second = seen.contexts[job.id]
    assert first is not second, "claimed again: the retry went through the queue"
    assert row(job).attempts == 2


async def _task_names() -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks()]


# -- what a handler does to its own task ---------------------------------------------------


def test_what_a_handler_does_to_its_own_task_ends_as_for_any_handler(seen):
    actions = {
        "self-cancel-return": ("failed", "CancelledError"),
        "self-cancel-uncancel": ("succeeded", None),
        "inner-timeout": ("failed", "TimeoutError"),
        "taskgroup-error": ("failed", "ConnectionError: a child failed"),
        "generator-exit": ("failed", "GeneratorExit"),
    }
    jobs = {action: enqueue(Act(action=action)) for action in actions}

    worker = run_jobs(registry(seen), *(j.id for j in jobs.values()))

    for action, (state, raised) in actions.items():
        done = row(jobs[action])
        assert done.state == state, (action, done.state, done.error_detail)
        if raised is not None:
            assert done.last_error == "handler_error", action
            assert raised in done.error_detail, (action, done.error_detail)
            assert "the worker failed" not in done.error_detail, action
    assert row(jobs["self-cancel-uncancel"]).result == "recovered"
    assert all(child.cancelled() for child in seen.children)
    assert worker.idle and worker.slots.in_flight == 0


# -- the paths that cancel only the handler's task -----------------------------------------


def test_a_deadline_ends_deadline_exceeded_whatever_the_handler_makes_of_it(seen):
    reactions = ["return", "value-error", "keyboard-interrupt", "timeout-scope", "taskgroup"]
    jobs = [enqueue(Act(action=f"await-{r}")) for r in reactions]

    worker = run_jobs(
        registry(seen, timeout=timedelta(milliseconds=300)), *(j.id for j in jobs), concurrency=5
    )

    for reaction, job in zip(reactions, jobs, strict=True):
        done = row(job)
        assert (done.state, done.last_error) == ("failed", "deadline_exceeded"), (
            reaction,
            done.error_detail,
        )
    assert seen.cancelled == len(reactions)
    assert worker.idle and worker.slots.in_flight == 0


def test_a_lost_lease_writes_nothing_whatever_the_handler_makes_of_it(seen):
    jobs = [enqueue(Act(action=f"await-{r}")) for r in ("return", "value-error")]
    worker = Worker(registry(seen), worker_config(lease=timedelta(seconds=0.3)))
    with Running(seen, worker):
        wait_for(lambda: seen.started == 2, interval=0.005)
        Job.objects.filter(pk__in=[j.id for j in jobs]).update(claim_token=STOLEN)
        wait_for(lambda: seen.cancelled == 2, timeout=5, interval=0.005)
        wait_for(lambda: worker.idle and worker.slots.in_flight == 0, timeout=5, interval=0.005)
    for job in jobs:
        stolen = row(job)
        assert (stolen.state, stolen.attempts, str(stolen.claim_token)) == ("running", 1, STOLEN)


def test_an_operator_cancel_ends_cancelled_whatever_the_handler_makes_of_it(seen):
    jobs = [enqueue(Act(action=f"await-{r}")) for r in ("return", "value-error")]
    worker = Worker(registry(seen, max_attempts=3), worker_config(lease=timedelta(seconds=0.6)))
    with Running(seen, worker):
        wait_for(lambda: seen.started == 2, interval=0.005)
        assert queue.cancel_running([j.id for j in jobs], by="operator") == sorted(
            j.id for j in jobs
        )
        wait_for(lambda: {row(j).state for j in jobs} == {"cancelled"}, interval=0.005)
        wait_for(lambda: worker.idle and worker.slots.in_flight == 0, interval=0.005)
    assert seen.cancelled == 2
    assert {row(j).last_error for j in jobs} == {"cancelled"}


def test_a_drain_hands_back_whatever_the_handler_makes_of_its_cancellation(seen):
    jobs = [enqueue(Act(action=f"await-{r}")) for r in ("return", "value-error", "reraise")]
    worker = Worker(registry(seen), worker_config(shutdown_timeout=0.3, cancel_timeout=5.0))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_for(lambda: seen.started == 3, interval=0.005)
    stopping = time.monotonic()
    worker.request_stop()
    thread.join(15)
    assert not thread.is_alive()
    assert time.monotonic() - stopping < 5, "the cancelled handlers returned at once"
    assert seen.cancelled == 3
    for job in jobs:
        back = row(job)
        assert (back.state, back.attempts, back.claim_token) == ("queued", 0, None)
    assert worker.slots.in_flight == 0


def test_a_drain_past_a_handler_ignoring_every_cancellation_keeps_its_lease_and_returns(seen):
    """Past cancel_timeout the job is abandoned with its lease; the loop's close cancels the
    job's task, which now waits for its handler: run() still returns, the loop thread lives
    on until the handler ends, then closes."""
    job = enqueue(Act(action="await-ignore"))
    worker = Worker(registry(seen), worker_config(shutdown_timeout=0.2, cancel_timeout=0.3))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_for(lambda: seen.started == 1, interval=0.005)
    loop = seen.loop
    worker.request_stop()
    thread.join(15)
    assert not thread.is_alive(), "run() returned though a handler ignores its cancellation"
    kept = row(job)
    assert (kept.state, kept.attempts) == ("running", 1)
    assert kept.claim_token is not None
    assert seen.cancelled >= 2  # the drain's cancel, then the loop's close
    assert loop is not None and not loop.is_closed()
    seen.release.set()
    wait_for(loop.is_closed, interval=0.005)
    assert row(job).state == "running", "abandoned: nothing written after the loop closed"
