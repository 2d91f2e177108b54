"""Job types the acceptance tests run in real worker processes."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from jobs import JobContext, Payload, RetryAfter, job
from jobs.registry import Backoff


class Trace(Payload, name="test.trace.v1"):
    """Append start/end lines to ``path``; sleep in between (cooperatively unless told not to)."""

    path: str
    seconds: float = 0.0
    ignore_cancel: bool = False


@job(
    Trace,
    concurrency=4,
    timeout=timedelta(seconds=120),
    max_attempts=5,
    backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100)),
)
def trace(payload: Trace, ctx: JobContext) -> int:
    pid = os.getpid()
    with open(payload.path, "a") as out:
        out.write(f"start {pid} {ctx.attempt}\n")
    if payload.ignore_cancel:
        time.sleep(payload.seconds)
    else:
        ctx.sleep(payload.seconds)
    with open(payload.path, "a") as out:
        out.write(f"end {pid} {ctx.attempt} {'cancelled' if ctx.cancelled.is_set() else 'ok'}\n")
    return pid


class RetryTrace(Payload, name="test.retry_trace.v1"):
    """Append a start line to ``path``, then ask to be retried after ``seconds``."""

    path: str
    seconds: float = 0.5


@job(RetryTrace, concurrency=2, timeout=timedelta(seconds=30), max_attempts=3)
def retry_trace(payload: RetryTrace, ctx: JobContext) -> None:
    with open(payload.path, "a") as out:
        out.write(f"start {os.getpid()} {ctx.attempt}\n")
    raise RetryAfter(payload.seconds)
