"""Property-based: any handler behaviour, through the real worker, leaves a correct queue.

Hypothesis generates what each attempt of each job does: return a value (JSON or not, with
NaN, NUL characters or lone surrogates), raise any exception type with any message text,
ask to be retried after any delay, or sleep around its timeout, cooperatively or not. The
jobs run through a real worker against real PostgreSQL; after each example the worker must
still claim new work and the queue must satisfy the invariants checked in ``check``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import JobContext, Payload, Reject, RetryAfter, enqueue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job
from jobs.runs import ErrorCode, RunState
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.support.worker import FAST_BACKOFF, Echo, Recorder, Unruly, echo_handler

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TIMEOUT = 0.25  # the generated type's timeout; sleeps are drawn around it


class PlannedV1(Payload, name="test.planned.v1"):
    token: str


# What each job's attempts do, by token (the plans hold values no payload could carry).
PLANS: dict[str, list[tuple]] = {}
RUNNING: dict[int, int] = {}
OVERLAPS: list[int] = []
_lock = threading.Lock()


def planned(payload: PlannedV1, ctx: JobContext):
    with _lock:
        RUNNING[ctx.id] = RUNNING.get(ctx.id, 0) + 1
        if RUNNING[ctx.id] > 1:
            OVERLAPS.append(ctx.id)
    try:
        plan = PLANS[payload.token]
        return act(plan[min(ctx.attempt, len(plan)) - 1], ctx)
    finally:
        with _lock:
            RUNNING[ctx.id] -= 1


def act(step: tuple, ctx: JobContext):
    kind = step[0]
    if kind == "return":
        return step[1]
    if kind == "raise":
        raise step[1](step[2])
    if kind == "retry_after":
        raise RetryAfter(step[1])
    if kind == "sleep":
        seconds, cooperative = step[1], step[2]
        if cooperative:
            ctx.sleep(seconds)
        else:
            time.sleep(seconds)
        return None
    raise AssertionError(kind)


# -- strategies ------------------------------------------------------------------------------

any_text = st.text(
    alphabet=st.characters(codec=None, categories=None, exclude_categories=()), max_size=20
)
json_ish = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
not_json = st.sampled_from([datetime(2026, 1, 1), object(), {1, 2}, b"bytes", Ellipsis])
exceptions = st.sampled_from(
    [
        ValueError,
        RuntimeError,
        KeyError,
        PermissionError,
        Reject,
        SystemExit,
        KeyboardInterrupt,
        asyncio.CancelledError,
        Unruly,
    ]
)
delays = st.one_of(
    st.floats(min_value=0, max_value=0.05),
    st.floats(min_value=120, max_value=1e300),
    st.just(math.inf),
    st.just(timedelta.max),
)
steps = st.one_of(
    st.tuples(st.just("return"), json_ish | not_json),
    st.tuples(st.just("raise"), exceptions, any_text),
    st.tuples(st.just("retry_after"), delays),
    st.tuples(
        st.just("sleep"),
        st.floats(min_value=0, max_value=TIMEOUT * 1.6),
        st.booleans(),
    ),
)
jobs_st = st.lists(
    st.tuples(st.lists(steps, min_size=1, max_size=3), st.integers(min_value=1, max_value=3)),
    min_size=1,
    max_size=4,
)


def registry(recorder: Recorder) -> Registry:
    policy = Policy(
        concurrency=4,
        timeout=timedelta(seconds=TIMEOUT),
        max_attempts=3,
        backoff=FAST_BACKOFF,
        permanent_errors=(PermissionError,),
    )
    return Registry(
        [
            JobType(PlannedV1, planned, policy),
            JobType(Echo, echo_handler(recorder), Policy(concurrency=4)),
        ]
    )


def settled(ids: list[int]) -> bool:
    now = time.time()
    for job in Job.objects.filter(pk__in=ids):
        if job.state == RunState.RUNNING:
            return False
        if job.state == RunState.QUEUED and job.run_after.timestamp() <= now + 5:
            return False
    return True


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(jobs=jobs_st)
def test_any_handler_behaviour_leaves_a_live_worker_and_a_valid_queue(jobs):
    ids = []
    limits = {}
    for plan, max_attempts in jobs:
        token = uuid.uuid4().hex
        PLANS[token] = plan
        done = enqueue(PlannedV1(token=token), max_attempts=max_attempts)
        ids.append(done.id)
        limits[done.id] = max_attempts
    probe: list[int] = []
    deadline = time.monotonic() + 30

    def until(w: Worker) -> bool:
        if time.monotonic() > deadline:
            return True
        if not probe:
            if not settled(ids):
                return False
            probe.append(enqueue(Echo(text="still alive?")).id)
        return w.idle and Job.objects.get(pk=probe[0]).state == RunState.SUCCEEDED

    config = WorkerConfig(
        concurrency=4,
        poll_interval=0.02,
        maintenance_interval=0.5,
        shutdown_timeout=1.0,
        install_signal_handlers=False,
    )
    Worker(registry(Recorder()), config).run(until=until)

    assert probe and Job.objects.get(pk=probe[0]).state == RunState.SUCCEEDED, "worker stuck"
    assert not OVERLAPS, f"jobs {OVERLAPS} ran in two handlers at once"
    codes = set(ErrorCode.values) | {""}
    for job in Job.objects.filter(pk__in=ids):
        assert job.state in (RunState.SUCCEEDED, RunState.FAILED, RunState.QUEUED), job
        assert job.last_error in codes, job.last_error
        assert 1 <= job.attempts <= limits[job.pk], (job.attempts, limits[job.pk])
        if job.state == RunState.QUEUED:  # waiting out a long RetryAfter
            assert job.attempts < limits[job.pk] and job.claim_token is None
        if job.state == RunState.FAILED:
            assert job.last_error and job.finished_at is not None
