"""Run one claimed job and decide its outcome (the outcome table).

Over 400 lines: the outcome table and every step that decides it are read in one place.

=================================  =========================================  =================
what happened                      next state                                 last_error
=================================  =========================================  =================
handler returned                   succeeded                                  (none)
payload fails decoding/validate    failed, handler never called               invalid_payload
handler raised Reject, or an       failed, no retry                           rejected
error its policy calls permanent
or jobs.errors.fail_now marked
handler overran its timeout        queued for retry; failed on last attempt   deadline_exceeded
any other error (BaseException     queued for retry; failed on last attempt   handler_error
too), or a transaction left open
a result that is not storable      failed, no retry                           handler_error
JSON
RetryAfter(delay)                  waited out in the worker when short (the   handler_error
                                   next attempt recorded first), else queued
                                   with that delay; failed on last
cancelled by an operator while     cancelled, not retried (the handler's      cancelled
running (learned at the next       cancellation flag is set; whatever it
lease renewal)                     returns or raises after that)
cancelled by a draining worker     handed back (attempt returned)             (kept)
lease lost meanwhile               nothing written (fenced)                   —
the handler's transaction called   nothing more written: it is succeeded      —
jobs.complete() and committed      (whatever the handler did afterwards)
=================================  =========================================  =================

An ``async def`` handler runs as a task on the worker's shared event loop
(:mod:`jobs.worker.on_loop`), judged by the same :func:`judge`, so the table holds for it
unchanged; its context's ``cancelled`` also cancels its task, raising ``CancelledError`` at
its current ``await``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections
from psycopg.pq import TransactionStatus

from jobs import queue
from jobs.api.effects import completed_by_handler
from jobs.catalogue.payloads import InvalidPayload
from jobs.catalogue.registry import JobType, classify
from jobs.core.context import JobContext
from jobs.errors import RetryAfter, fails_now
from jobs.queue import ClaimedJob, InvalidResult, Outcome, bound
from jobs.queue.bound import RunRow
from jobs.queue.types import clamp_delay
from jobs.runs import ErrorCode
from jobs.worker import metrics, thread_connections
from jobs.worker.event_loop import CancelEvent, run_async

logger = logging.getLogger("jobs.worker")
IDLE = TransactionStatus.IDLE


@dataclass(eq=False)
class Running:
    """A job this worker holds, from claim until its outcome is written.

    The flags change under the worker's lock: ``started`` and ``handed_back`` decide, between
    a handler thread and a draining worker, which of them has the job.
    """

    job: ClaimedJob
    job_type: JobType
    ctx: JobContext
    lost: bool = False  # lease lost or abandoned at exit: write no outcome
    started: bool = False  # a handler thread took the job
    finished: bool = False  # the handler returned; the outcome may wait for the next flush
    handed_back: bool = False  # released by a drain before any handler thread took it
    cancel_requested: bool = False  # an operator asked this attempt to stop: it ends cancelled
    shutdown: bool = False  # cancelled by a drain: hand the job back whatever happens
    claimed_at: float = field(default_factory=time.monotonic)
    # When its lease last began, by this process's clock: the claim's sending (the run loop
    # passes it), then the start of each renewal that wrote the row. A lease after it, the
    # keeper gives the job up.
    leased_at: float = field(default_factory=time.monotonic)
    attempt: int = 0  # the attempt the queue recorded last (claim or next_attempt)
    run: RunRow | None = None  # its bound run row (policy.run_model), once the payload is decoded
    # RetryAfter(throttle=True): pause the whole type this many seconds, for this reason.
    throttle: tuple[float, str] | None = None
    # The handler's own transaction marked the job succeeded (jobs.complete): no outcome.
    completed: bool = False
    # Passes whose outcome write found the row locked by another session (a renewal of this
    # worker's, usually for a moment; a long transaction on jobs_job, if it goes on).
    busy_passes: int = 0
    # Its outcome met a lock or statement timeout: it is written alone from then on
    # (jobs.worker.completer), never again in a pass statement it could hold up.
    contended: bool = False


@cache
def _handler_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"jobs.handler.{name}")


def make_context(
    job: ClaimedJob, job_type: JobType, *, using: str = DEFAULT_DB_ALIAS
) -> JobContext:
    """The handler's context for ``job``, claimed on the database alias ``using``."""
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
        timeout=job_type.timeout_seconds,
        logger=adapter,
        # For a coroutine, "told to stop" is also a cancelled task (jobs.worker.event_loop).
        cancelled=CancelEvent() if job_type.is_async else threading.Event(),
        claim_token=job.claim_token,
        using=using,
    )


def execute(
    running: Running, *, shutting_down: Callable[[], bool], lease: timedelta | None = None
) -> Outcome | None:
    """Decode, call the handler (again, for short in-process retries) and return the outcome.

    Runs on a handler thread. Whatever the handler does (returns anything, raises any
    ``BaseException``, leaves a transaction open) ends in an outcome, or in None when the job
    is no longer this worker's to report on. :func:`jobs.worker.on_loop.execute_on_loop` is
    the same for ``async def`` handlers, on the event loop.
    """
    job, job_type, ctx = running.job, running.job_type, running.ctx
    decoded = decode(running)
    if isinstance(decoded, Outcome):
        return decoded
    while True:
        if running.lost:  # given up before this call (the watch does not wait for us)
            return None
        if running.cancel_requested:  # an operator's cancel while it was held, unstarted
            return Outcome.cancelled(job)
        mark_running(running)
        error, result, duration = _call(job_type, decoded.payload, ctx)
        metrics.for_type(job.name).handler_duration.observe(duration)
        left_open = close_open_transactions(failed=error is not None)
        verdict = judge(running, error, result, duration, left_open)
        if running.completed:
            sync_completed(running)
        if not isinstance(verdict, WaitAndRetry):
            return verdict
        interrupted = _wait_in_process(running, verdict.delay, shutting_down)
        if running.lost:
            return None
        if not interrupted:
            attempt = count_next_attempt(running, lease, verdict.otherwise)
            if attempt is None:  # lost, or asked to stop
                return Outcome.cancelled(job) if running.cancel_requested else None
            if attempt:
                continue
        return verdict.otherwise


@dataclass(frozen=True, slots=True)
class Decoded:
    payload: Any


@dataclass(frozen=True, slots=True)
class WaitAndRetry:
    """A short RetryAfter: wait ``delay`` in process and run again, else ``otherwise``."""

    delay: float
    otherwise: Outcome


def decode(running: Running) -> Decoded | Outcome:
    """The decoded payload (noting the bound run row), or the invalid_payload outcome."""
    job, job_type = running.job, running.job_type
    try:
        payload = job_type.decode(job.payload)
        model = job_type.policy.run_model
        if model is not None and (pk := getattr(payload, job_type.policy.run_field)) is not None:
            running.run = RunRow(model, pk)
    except BaseException as exc:  # any failure to decode is the payload's
        return Outcome.failed(job, code=ErrorCode.INVALID_PAYLOAD, detail=_payload_error(exc))
    return Decoded(payload)


def mark_running(running: Running) -> None:
    """The bound run row (policy.run_model) enters this attempt; on the handler's thread."""
    if running.run is not None:
        bound.started(running.run, attempt=current_attempt(running), using=running.ctx.using)


def judge(
    running: Running,
    error: BaseException | None,
    result: Any,
    duration: float,
    left_open: list[str],
) -> Outcome | WaitAndRetry | None:
    """The outcome of one call of the handler (the table in the module docstring)."""
    job, job_type, ctx = running.job, running.job_type, running.ctx
    if completed_by_handler(ctx):  # committed: whatever the handler did afterwards
        running.completed = True
        return None
    if running.lost:
        return None
    if running.cancel_requested:  # whatever the handler did since: the operator said stop
        return Outcome.cancelled(job)
    if running.shutdown:
        return Outcome.released(job)
    if left_open:
        detail = (
            f"the handler left a transaction open on database {', '.join(left_open)}; "
            "it was rolled back, so the handler's writes there were not saved"
        )
        if error is not None:
            detail += "\n\n" + _describe(error)
        return failure_outcome(running, ErrorCode.HANDLER_ERROR, detail)
    if time.monotonic() > ctx.deadline:
        return failure_outcome(
            running,
            ErrorCode.DEADLINE_EXCEEDED,
            f"handler ran {duration:.3f}s, over its {ctx.timeout:g}s timeout",
        )
    if error is None:
        return _succeeded(running, result)
    kind = _classify(job_type, error)
    detail = _describe(error)
    if kind in ("reject", "permanent"):
        return Outcome.failed(job, code=ErrorCode.REJECTED, detail=detail)
    if kind == "retry_after" and isinstance(error, RetryAfter):  # always both
        delay = clamp_delay(error.delay)
        otherwise = failure_outcome(running, ErrorCode.HANDLER_ERROR, detail, delay=delay)
        threshold = job_type.policy.in_process_limit().total_seconds()
        if error.throttle:  # the type pauses: the job waits in the queue, not in a slot
            running.throttle = (delay, detail)
            return otherwise
        if current_attempt(running) < job.max_attempts and delay <= threshold:
            return WaitAndRetry(delay, otherwise)
        return otherwise
    return failure_outcome(running, ErrorCode.HANDLER_ERROR, detail)


def _call(
    job_type: JobType, payload: Any, ctx: JobContext
) -> tuple[BaseException | None, Any, float]:
    started = time.monotonic()
    try:
        if job_type.is_async:  # outside the worker's dispatch (which runs them on the loop)
            result = run_async(job_type.handler, payload, ctx)
        else:
            result = job_type.handler(payload, ctx)
    except BaseException as exc:  # SystemExit, CancelledError: all outcomes
        return exc, None, time.monotonic() - started
    return None, result, time.monotonic() - started


def _classify(job_type: JobType, error: BaseException) -> str:
    """The policy's classification; BaseExceptions that are not Exceptions are transient.

    An error marked by :func:`jobs.errors.fail_now` is a rejection whatever its class.
    """
    if fails_now(error):
        return "reject"
    if not isinstance(error, Exception):
        return "transient"
    try:
        kind = classify(job_type.policy, error)
        if kind == "retry_after" and isinstance(error, RetryAfter):  # always both
            clamp_delay(error.delay)  # a RetryAfter subclass with a broken delay is transient
        return kind
    except BaseException:  # a broken classify() hook must not lose the outcome
        logger.exception(
            "classifying an error of %s failed; treating it as transient", job_type.name
        )
        return "transient"


def close_open_transactions(*, failed: bool = False) -> list[str]:
    """Roll back what a handler left open on this thread's connections; their aliases.

    A handler that leaves ``atomic()`` unexited, turns autocommit off, or starts a
    transaction on the raw connection has not committed its writes; reusing the connection
    would let the worker's own writes join that transaction. The connection is closed (the
    server rolls back) and replaced by a fresh one on next use. After a handler that
    ``failed`` every connection is looked at, even on a thread that announced none: a
    connection whose set-up failed half-way was never announced.
    """
    if failed:
        thread_connections.may_have_opened()
    dirty = []
    for conn in thread_connections.open_connections():
        raw = conn.connection
        if raw is None:
            continue
        try:
            if raw.closed:  # closed by the handler: nothing left open, just start afresh
                if not conn.in_atomic_block:
                    del connections[conn.alias]
                    continue
                open_ = True
            else:
                open_ = (
                    conn.in_atomic_block
                    or not conn.get_autocommit()
                    or not raw.autocommit  # turned off on the raw psycopg connection
                    or raw.info.transaction_status != IDLE
                )
        except Exception:  # a connection too broken to ask is not reused either
            open_ = True
        if not open_:
            continue
        dirty.append(conn.alias)
        try:
            raw.close()
        except Exception:
            logger.debug("closing connection %s failed", conn.alias, exc_info=True)
        del connections[conn.alias]  # the next use of the alias opens a fresh connection
    return dirty


def _wait_in_process(running: Running, delay: float, shutting_down: Callable[[], bool]) -> bool:
    """Sleep out a short Retry-After, keeping the lease; True when interrupted.

    An interrupted wait (cancelled or shutting down) hands the retry to the queue instead.
    """
    ctx = running.ctx
    # The next attempt's clock starts after the wait: no deadline passes while waiting.
    ctx.started = time.monotonic() + delay
    return ctx.sleep(delay) or shutting_down()


def count_next_attempt(running: Running, lease: timedelta | None, ended: Outcome) -> int | None:
    """Record the next attempt before running it; None if fenced or asked to stop (then
    ``running.cancel_requested`` is set), 0 if it could not be saved.

    ``ended`` is the retry the attempt that just ended would have been: its code and detail
    go to the attempt log.
    """
    ctx = running.ctx
    try:
        attempt = queue.next_attempt(
            running.job,
            lease=lease,
            code=ended.code or "",
            detail=ended.detail or "",
            local_bounds=True,  # the worker's write on the handler's connection
            using=ctx.using,
        )
    except Exception:
        logger.warning(
            "could not record the next attempt of job %s; retrying it through the queue",
            ctx.job_id,
            exc_info=True,
        )
        return 0
    if attempt is None:
        if _cancel_asked(running, lease):
            running.cancel_requested = True
            ctx.cancelled.set()
        else:
            running.lost = True
        return None
    running.attempt = ctx.attempt = attempt
    ctx.started = time.monotonic()
    return attempt


def _cancel_asked(running: Running, lease: timedelta | None) -> bool:
    """Whether the job, refused its next attempt, is still ours and was asked to stop."""
    try:
        renewal = queue.renew_leases(
            [running.job], lease=lease, local_bounds=True, using=running.ctx.using
        )
    except Exception:  # unknown: treat it as lost, as a refused attempt always was
        return False
    return running.job.claim_token in renewal.cancel_requested


def _succeeded(running: Running, result: Any) -> Outcome:
    try:
        return Outcome.succeeded(running.job, result)
    except InvalidResult as exc:
        # Running the handler again would return the same kind of value: fail at once.
        return Outcome.failed(
            running.job,
            code=ErrorCode.HANDLER_ERROR,
            detail=f"the handler returned {type(result).__name__}, and {exc}",
        )


def current_attempt(running: Running) -> int:
    """The attempt the queue has recorded for this claim (the handler cannot change it)."""
    return max(running.job.attempts, running.attempt)


def failure_outcome(
    running: Running, code: str, detail: str, delay: float | None = None
) -> Outcome:
    """A retry after the policy's backoff (or ``delay``), or a failure on the last attempt.

    Reads the attempt the worker recorded, not the handler's context, which the handler
    may have changed.
    """
    job = running.job
    attempt = current_attempt(running)
    if attempt >= job.max_attempts:
        return Outcome.failed(job, code=code, detail=detail)
    if delay is None:
        try:
            delay = running.job_type.policy.resolved_backoff().delay(attempt)
        except Exception:
            delay = 1.0
    return Outcome.retry(job, code=code, detail=detail, delay=delay)


def _describe(error: BaseException) -> str:
    """The error's traceback exactly as Python formats it (``django.tasks`` results show it
    as their ``TaskError.traceback``, which Django defines so)."""
    try:
        return "".join(traceback.format_exception(error))
    except Exception:  # an exception whose __str__ raises
        return f"{type(error).__qualname__} (its message could not be formatted)"


def _payload_error(exc: BaseException) -> str:
    if isinstance(exc, InvalidPayload):
        return str(exc)
    return f"decoding the payload raised {type(exc).__qualname__}:\n{_describe(exc)}"


def sync_completed(running: Running) -> None:
    """The bound run row of a job its handler completed (jobs.complete) follows it; on the
    handler's thread, after the handler's transaction (a failure is logged, not raised)."""
    if running.run is None:
        return
    try:
        bound.completed(running.run, Outcome.succeeded(running.job), using=running.ctx.using)
    except Exception:
        logger.exception("could not mark the run row of job %s succeeded", running.job.job_id)


def run_rows(held: Iterable[Running]) -> dict[UUID, RunRow]:
    """The bound run rows of ``held`` jobs, by claim token, for the queue's writes."""
    return {r.job.claim_token: r.run for r in held if r.run is not None}
