"""Run one claimed job and decide its outcome (the outcome table).

=================================  =========================================  =================
what happened                      next state                                 last_error
=================================  =========================================  =================
handler returned                   succeeded                                  (none)
payload fails decoding/validate    failed, handler never called               invalid_payload
handler raised Reject, or an       failed, no retry                           rejected
error its policy calls permanent
handler overran its timeout        queued for retry; failed on last attempt   deadline_exceeded
any other error                    queued for retry; failed on last attempt   handler_error
RetryAfter(delay)                  waited out in the worker when short, else  handler_error
                                   queued with that delay; failed on last
lease lost meanwhile               nothing written (fenced)                   —
=================================  =========================================  =================
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from jobs import runs
from jobs.conf import as_timedelta
from jobs.context import JobContext
from jobs.payloads import InvalidPayload
from jobs.queue import ClaimedJob, Outcome
from jobs.registry import JobType, classify
from jobs.runs import ErrorCode
from jobs.worker import metrics

logger = logging.getLogger("jobs.worker")


@dataclass(eq=False)
class Running:
    """A job this worker holds, from claim until its outcome is written."""

    job: ClaimedJob
    job_type: JobType
    ctx: JobContext
    lost: bool = False  # lease lost or handed back: write no outcome
    finished: bool = False  # the handler returned; the outcome may wait for the next flush
    extra_attempts: int = 0  # retries waited out in-process, added to attempts at the end
    claimed_at: float = field(default_factory=time.monotonic)
    run_pk: object = None  # the bound run row (policy.run_model), once the payload is decoded


@cache
def _handler_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"jobs.handler.{name}")


def make_context(job: ClaimedJob, job_type: JobType) -> JobContext:
    adapter = logging.LoggerAdapter(
        _handler_logger(job.name),
        {"job_id": job.job_id, "job_type": job.name, "tenant": job.tenant, "attempt": job.attempts},
    )
    return JobContext(
        id=job.id,
        job_id=job.job_id,
        name=job.name,
        tenant=job.tenant,
        attempt=job.attempts,
        max_attempts=job.max_attempts,
        timeout=as_timedelta(job_type.policy.timeout).total_seconds(),
        logger=adapter,
    )


def execute(running: Running, *, shutting_down: Callable[[], bool]) -> Outcome | None:
    """Decode, call the handler (again, for short in-process retries) and return the outcome."""
    job, job_type, ctx = running.job, running.job_type, running.ctx
    try:
        payload = job_type.decode(job.payload)
    except InvalidPayload as exc:
        return Outcome.failed(job, code=ErrorCode.INVALID_PAYLOAD, detail=str(exc))
    run_model = job_type.policy.run_model
    if run_model is not None:
        running.run_pk = getattr(payload, job_type.policy.run_field)
    while True:
        if run_model is not None:
            runs.mark_running(run_model, running.run_pk, attempt=ctx.attempt)
        error, result, duration = _call(job_type, payload, ctx)
        metrics.for_type(job.name).handler_duration.observe(duration)
        if running.lost:
            return None
        overran = time.monotonic() > ctx.deadline
        if error is None and not overran:
            return _succeeded(running, result)
        if overran:
            return _retry_or_fail(
                running,
                ErrorCode.DEADLINE_EXCEEDED,
                f"handler ran {duration:.3f}s, over its {ctx.timeout:g}s timeout",
            )
        kind = classify(job_type.policy, error)
        detail = _describe(error)
        if kind in ("reject", "permanent"):
            return _with_attempts(
                running, Outcome.failed(job, code=ErrorCode.REJECTED, detail=detail)
            )
        if kind == "retry_after":
            delay = error.delay
            threshold = job_type.policy.in_process_limit().total_seconds()
            if not ctx.final_attempt and delay <= threshold:
                if not _wait_in_process(running, delay, shutting_down):
                    continue
                if running.lost:
                    return None
            return _retry_or_fail(running, ErrorCode.HANDLER_ERROR, detail, delay=delay)
        return _retry_or_fail(running, ErrorCode.HANDLER_ERROR, detail)


def _call(
    job_type: JobType, payload: Any, ctx: JobContext
) -> tuple[BaseException | None, Any, float]:
    started = time.monotonic()
    try:
        if job_type.is_async:
            result = asyncio.run(job_type.handler(payload, ctx))
        else:
            result = job_type.handler(payload, ctx)
    except Exception as exc:
        return exc, None, time.monotonic() - started
    return None, result, time.monotonic() - started


def _wait_in_process(running: Running, delay: float, shutting_down: Callable[[], bool]) -> bool:
    """Sleep out a short Retry-After, keeping the lease; False means try again now.

    Returns True when the wait was interrupted (cancelled or shutting down): the caller then
    hands the retry to the queue instead.
    """
    ctx = running.ctx
    # The next attempt's clock starts after the wait, so the lease keeper keeps renewing.
    ctx.started = time.monotonic() + delay
    interrupted = ctx.sleep(delay) or shutting_down()
    if interrupted:
        return True
    running.extra_attempts += 1
    ctx.attempt += 1
    ctx.started = time.monotonic()
    return False


def _succeeded(running: Running, result: Any) -> Outcome:
    try:
        json.dumps(result)
    except (TypeError, ValueError) as exc:
        return _with_attempts(
            running,
            Outcome.failed(
                running.job,
                code=ErrorCode.HANDLER_ERROR,
                detail=f"the handler's return value is not JSON-serializable: {exc}",
            ),
        )
    return _with_attempts(running, Outcome.succeeded(running.job, result))


def _retry_or_fail(running: Running, code: str, detail: str, delay: float | None = None) -> Outcome:
    job, ctx = running.job, running.ctx
    if ctx.final_attempt:
        return _with_attempts(running, Outcome.failed(job, code=code, detail=detail))
    if delay is None:
        delay = running.job_type.policy.resolved_backoff().delay(ctx.attempt)
    return _with_attempts(running, Outcome.retry(job, code=code, detail=detail, delay=delay))


def _with_attempts(running: Running, outcome: Outcome) -> Outcome:
    """Count the attempts waited out in-process, which the queue has not seen yet."""
    if not running.extra_attempts:
        return outcome
    return replace(outcome, attempts_delta=running.extra_attempts)


def _describe(error: BaseException) -> str:
    text = "".join(traceback.format_exception(error))
    return text.strip()


def sync_run_rows(settled: list[tuple[Running, Outcome]]) -> None:
    """Carry written outcomes over to the rows of bound run tables (policy.run_model)."""
    for running, outcome in settled:
        model = running.job_type.policy.run_model
        if model is None or running.run_pk is None:
            continue
        runs.mark_outcome(
            model,
            running.run_pk,
            state=outcome.state,
            code=outcome.code or "",
            detail=outcome.detail or "",
            retry_in=outcome.delay if outcome.at is None else None,
        )
