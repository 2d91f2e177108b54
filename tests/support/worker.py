"""Payloads, handlers and registries the worker tests run (module level, as real ones are),
and real workers run by a test: in its thread until a condition, or beside it in another."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

from django.db import connection
from django.utils import timezone

from jobs import JobContext, Payload, Reject, RetryAfter
from jobs.catalogue.registry import Backoff, JobType, Policy, Registry
from jobs.models import Job
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker

FAST_BACKOFF = Backoff(base=timedelta(milliseconds=10), cap=timedelta(milliseconds=50))


class Echo(Payload, name="test.echo.v1"):
    text: str

    def validate(self) -> None:
        if self.text == "invalid":
            raise ValueError("text must not be 'invalid'")


class Step(Payload, name="test.step.v1"):
    """Tells the scripted handler what to do on each attempt: ok, error, reject, slow, retry."""

    plan: tuple[str, ...] = ()
    seconds: float = 0.0


class Recorder:
    """Thread-safe record of handler calls: payloads, contexts and peak concurrency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[Payload, JobContext]] = []
        self.active = Counter()
        self.peak = Counter()

    def enter(self, payload: Payload, ctx: JobContext) -> None:
        with self.lock:
            self.calls.append((payload, ctx))
            self.active[ctx.name] += 1
            self.peak[ctx.name] = max(self.peak[ctx.name], self.active[ctx.name])

    def leave(self, ctx: JobContext) -> None:
        with self.lock:
            self.active[ctx.name] -= 1


def scripted(recorder: Recorder):
    """A handler that follows Step.plan[attempt - 1] (the last entry repeats)."""

    def handle(payload: Step, ctx: JobContext):
        recorder.enter(payload, ctx)
        try:
            action = payload.plan[min(ctx.attempt, len(payload.plan)) - 1] if payload.plan else "ok"
            if action == "error":
                raise ConnectionError("upstream unavailable")
            if action == "reject":
                raise Reject("can never succeed")
            if action == "permanent":
                raise PermissionError("not allowed")
            if action == "slow":
                ctx.sleep(payload.seconds)
                return None
            if action == "ignore-cancel":
                time.sleep(payload.seconds)
                return None
            if action == "retry-after":
                raise RetryAfter(payload.seconds)
            if action == "sleep":
                time.sleep(payload.seconds)
            return {"attempt": ctx.attempt}
        finally:
            recorder.leave(ctx)

    return handle


def echo_handler(recorder: Recorder):
    def handle(payload: Echo, ctx: JobContext):
        recorder.enter(payload, ctx)
        recorder.leave(ctx)
        return payload.text

    return handle


def registry(recorder: Recorder, **policy) -> Registry:
    step_policy = {
        "concurrency": 4,
        "timeout": timedelta(seconds=5),
        "max_attempts": 3,
        "backoff": FAST_BACKOFF,
        "permanent_errors": (PermissionError,),
        **policy,
    }
    return Registry(
        [
            JobType(Echo, echo_handler(recorder), Policy(concurrency=4)),
            JobType(Step, scripted(recorder), Policy(**step_policy)),
        ]
    )


class Hostile(Payload, name="test.hostile.v1"):
    """Tells the hostile handler how to misbehave (see ``hostile``)."""

    action: str
    seconds: float = 0.0


class Unruly(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


class BrokenRetryAfter(RetryAfter):
    """A RetryAfter whose delay cannot be read."""

    @property
    def delay(self):
        raise RuntimeError("no delay for you")

    @delay.setter
    def delay(self, value):
        pass


def hostile(recorder: Recorder):
    """A handler that returns, raises or leaves behind whatever ``payload.action`` says."""
    import asyncio
    import math
    from datetime import datetime

    from django.db import connection, transaction

    from jobs.models import TenantOverride

    def handle(payload: Hostile, ctx: JobContext):
        recorder.enter(payload, ctx)
        try:
            action = payload.action
            if action == "ok":
                return {"fine": True}
            if action == "nul-error":
                raise RuntimeError("bad\x00text and a lone \udc80 surrogate")
            if action == "nan-result":
                return {"score": math.nan}
            if action == "nul-result":
                return {"text": "a\x00b"}
            if action == "datetime-result":
                return datetime.now()
            if action == "refuse-me":
                return "refuse-me"
            if action == "retry-max":
                raise RetryAfter(timedelta.max)
            if action == "system-exit":
                raise SystemExit(3)
            if action == "keyboard-interrupt":
                raise KeyboardInterrupt
            if action == "cancelled-error":
                raise asyncio.CancelledError
            if action == "unruly":
                raise Unruly("not an Exception")
            if action == "open-atomic":
                transaction.atomic().__enter__()
                TenantOverride.objects.create(tenant="left-open", component="x")
                return None
            if action == "autocommit-off":
                connection.set_autocommit(False)
                TenantOverride.objects.create(tenant="no-autocommit", component="x")
                return None
            if action == "ignore-cancel":
                time.sleep(payload.seconds)
                return None
            if action == "mangle-ctx":  # a nonsense value where the keeper reads the deadline
                ctx.timeout = timedelta(seconds=120)
                ctx.sleep(payload.seconds)
                return None
            if action == "zero-attempt":
                ctx.attempt = 0
                raise RuntimeError("and now my attempt is 0")
            if action == "slow-first":  # a long first attempt, quick later ones
                ctx.sleep(payload.seconds if ctx.attempt == 1 else 0.05)
                return {"attempt": ctx.attempt}
            if action == "huge-result":
                return "y" * 2_000_000
            if action == "broken-retry-after":
                raise BrokenRetryAfter(1)
            if action == "raw-close":
                TenantOverride.objects.create(tenant=f"raw-close-{ctx.attempt}", component="x")
                connection.connection.close()
                return None
            if action == "raw-autocommit-off":
                connection.ensure_connection()
                connection.connection.autocommit = False
                TenantOverride.objects.create(tenant="raw-autocommit", component="x")
                return None
            raise AssertionError(f"unknown action {action}")
        finally:
            recorder.leave(ctx)

    return handle


def hostile_registry(recorder: Recorder, **policy) -> Registry:
    options = {
        "concurrency": 8,
        "timeout": timedelta(seconds=5),
        "max_attempts": 3,
        "backoff": FAST_BACKOFF,
        **policy,
    }
    return Registry(
        [
            JobType(Echo, echo_handler(recorder), Policy(concurrency=8)),
            JobType(Hostile, hostile(recorder), Policy(**options)),
        ]
    )


@contextmanager
def running_worker(registry: Registry, **config) -> Iterator:
    """A Worker (no signal handlers, 50 ms polls unless ``config`` says otherwise) running in
    a thread of this process; stopped, and its thread joined, on leaving."""
    worker = Worker(
        registry,
        WorkerConfig(**{"install_signal_handlers": False, "poll_interval": 0.05, **config}),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(20)
    assert not thread.is_alive()


def run_on(pool, task: Callable[[], object]) -> object:
    """Run ``task`` on a handler pool and return what it returned (its exception is raised
    here)."""
    results: queue.SimpleQueue = queue.SimpleQueue()

    def wrapped() -> None:
        try:
            results.put((True, task()))
        except BaseException as exc:
            results.put((False, exc))

    pool.submit(wrapped)
    ok, value = results.get(timeout=10)
    if not ok:
        raise value
    return value


def fake_held_job(name: str, id: int = 1, **fields: object) -> SimpleNamespace:
    """What the executor's ``run_on_thread`` and ``finished`` read of a held job, for tests that
    call them directly, with no row behind it; ``fields`` adds or replaces attributes."""
    job = SimpleNamespace(name=name, id=id, claim_token=uuid.uuid4(), job_id=f"j{id}")
    held = {
        "ctx": SimpleNamespace(),  # its handler's start sets the timeout's clock here
        "handed_back": False,
        "started": False,
        "lost": False,
        "finished": False,
        "completed": False,
    }
    return SimpleNamespace(job=job, **{**held, **fields})


def run_until(registry, done, *, timeout=15.0, **config) -> Worker:
    """Run a real worker in this thread until ``done(worker)`` or the deadline."""
    options = {
        "concurrency": 4,
        "poll_interval": 0.05,
        "maintenance_interval": 0.5,
        "shutdown_timeout": 1.0,
        "install_signal_handlers": False,
        **config,
    }
    worker = Worker(registry, WorkerConfig(**options))
    deadline = time.monotonic() + timeout
    timed_out = []

    def until(w: Worker) -> bool:
        if time.monotonic() > deadline:
            timed_out.append(True)
            return True
        return done(w)

    worker.run(until=until)
    assert not timed_out, "the worker did not get there before the deadline"
    return worker


ACTIVE = ("queued", "running")


def settled(*ids: int) -> bool:
    """Every one of these jobs has left the active states (or waits for a far retry)."""
    rows = Job.objects.filter(pk__in=ids).values_list("state", "run_after")
    return all(
        state not in ACTIVE or (state == "queued" and run_after > timezone.now())
        for state, run_after in rows
    )


@contextmanager
def refusing_trigger(message: str, errcode: str):
    """A user's trigger on the jobs table that refuses results saying 'refuse-me'."""
    with connection.cursor() as cur:
        cur.execute(
            f"""
            CREATE FUNCTION refuse_me() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.result::text LIKE '%%refuse-me%%' THEN
                    RAISE EXCEPTION '{message}' USING ERRCODE = '{errcode}';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER refuse_me BEFORE UPDATE ON jobs_job
                FOR EACH ROW EXECUTE FUNCTION refuse_me();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute("DROP TRIGGER refuse_me ON jobs_job; DROP FUNCTION refuse_me()")


def worker_config(**options) -> WorkerConfig:
    """A worker's configuration for a test in this process: no signal handlers, short polls
    and a short shutdown; ``options`` override any of it."""
    defaults = {
        "concurrency": 4,
        "poll_interval": 0.05,
        "maintenance_interval": 0.5,
        "shutdown_timeout": 1.0,
        "install_signal_handlers": False,
    }
    return WorkerConfig(**{**defaults, **options})


def run_jobs(registry: Registry, *ids: int, **options) -> Worker:
    """Run a real worker in this thread until the jobs ``ids`` have ended and it is idle (or
    15 seconds have passed); the worker, to read what it counted."""
    worker = Worker(registry, worker_config(**options))
    deadline = time.monotonic() + 15

    def done(w: Worker) -> bool:
        states = Job.objects.filter(pk__in=ids).values_list("state", flat=True)
        finished = w.idle and all(s in ("succeeded", "failed") for s in states)
        return finished or time.monotonic() > deadline

    worker.run(until=done)
    return worker
