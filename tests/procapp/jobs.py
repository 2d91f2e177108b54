"""Job types the acceptance tests run in real worker processes."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from jobs import JobContext, Payload, Rate, RetryAfter, job
from jobs.catalogue.registry import Backoff


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


# -- flow control: handlers that record when they run, in the database ----------------------


class FlowEntry(Payload, name="test.flow_global.v1"):
    """Record this handler's entry and exit in ``test_flow_entries``; sleep in between.

    The test creates the table. ``throttle_first`` makes the first attempt ask the whole type
    to slow down for that many seconds.
    """

    seconds: float = 0.05
    throttle_first: float = 0.0


def _flow_entry(payload: FlowEntry, ctx: JobContext) -> None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO test_flow_entries (job_id, type, tenant, pid, entered) "
            "VALUES (%s, %s, %s, %s, clock_timestamp()) RETURNING id",
            [ctx.job_id, ctx.name, ctx.tenant, os.getpid()],
        )
        (entry,) = cur.fetchone()
    try:
        if payload.throttle_first and ctx.attempt == 1:
            raise RetryAfter(payload.throttle_first, "upstream said 429", throttle=True)
        ctx.sleep(payload.seconds)
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE test_flow_entries SET left_at = clock_timestamp() WHERE id = %s", [entry]
            )


class FlowTenant(FlowEntry, name="test.flow_tenant.v1"):
    pass


class FlowRate(FlowEntry, name="test.flow_rate.v1"):
    pass


class FlowFair(FlowEntry, name="test.flow_fair.v1"):
    pass


class FlowFairLimited(FlowEntry, name="test.flow_fair_limited.v1"):
    pass


job(FlowEntry, global_concurrency=3, timeout=30, max_attempts=5)(_flow_entry)
job(FlowTenant, tenant_concurrency=2, timeout=30, max_attempts=5)(_flow_entry)
job(FlowRate, rate_limit=Rate(20, per=1), timeout=30, max_attempts=5)(_flow_entry)
job(FlowFair, fair=True, timeout=30, max_attempts=5)(_flow_entry)
job(FlowFairLimited, fair=True, global_concurrency=30, timeout=30, max_attempts=5)(_flow_entry)


# -- workflows: members that finish together, a successor that records each run --------------


class GateMember(Payload, name="test.gate_member.v1"):
    """Wait until the file ``gate`` exists (or ``seconds`` pass), then succeed or fail."""

    gate: str
    fail: bool = False
    seconds: float = 30.0


@job(GateMember, concurrency=20, timeout=timedelta(seconds=60), max_attempts=3)
def gate_member(payload: GateMember, ctx: JobContext) -> None:
    deadline = time.monotonic() + payload.seconds
    while not os.path.exists(payload.gate) and time.monotonic() < deadline:
        if ctx.sleep(0.01):
            return
    if payload.fail:
        from jobs import Reject

        raise Reject("this member fails for good")


class BatchReport(Payload, name="test.batch_report.v1"):
    """A batch's successor: append one line per run with the counts it read to ``path``."""

    path: str


@job(BatchReport, concurrency=2, timeout=timedelta(seconds=30))
def batch_report(payload: BatchReport, ctx: JobContext) -> None:
    from jobs import Batch

    batch = Batch.finished_by(ctx)
    state = batch.state() if batch else None
    with open(payload.path, "a") as out:
        if state is None:
            out.write(f"run {os.getpid()} no-batch\n")
        else:
            failed = len(batch.failures()) if batch else 0
            out.write(
                f"run {os.getpid()} {state.total} {state.succeeded} {state.failed} "
                f"{state.cancelled} {failed}\n"
            )


# -- the effect journal: a payment provider in a table, and a worker killed mid-effect -------


class Charge(Payload, name="test.effect_charge.v1"):
    """Charge ``amount`` through the pretend provider (``test_provider_charges``, which the
    test creates: one row per idempotency key it accepted, counting the requests with it).

    On attempt 1 the handler writes ``signal`` and blocks for good (the test kills it):
    after the provider took the charge (``block="after_call"``) or before the request
    reached it (``block="before_call"``). Every call and reconcile is traced to ``path``.
    """

    amount: int
    path: str
    signal: str
    block: str = ""


def _provider_charge(key: str, amount: int) -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO test_provider_charges (key, amount) VALUES (%s, %s) ON CONFLICT (key) "
            "DO UPDATE SET requests = test_provider_charges.requests + 1 RETURNING id",
            [key, amount],
        )
        (charge,) = cur.fetchone()
    return {"charge": charge}


def _provider_lookup(key: str) -> dict[str, int] | None:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT id FROM test_provider_charges WHERE key = %s", [key])
        row = cur.fetchone()
    return None if row is None else {"charge": row[0]}


@job(Charge, timeout=timedelta(seconds=30), max_attempts=3)
def charge(payload: Charge, ctx: JobContext) -> object:
    import jobs

    def trace(line: str) -> None:
        with open(payload.path, "a") as out:
            out.write(f"{line} {os.getpid()} {ctx.attempt}\n")

    def block() -> None:
        with open(payload.signal, "w") as out:
            out.write(str(os.getpid()))
        time.sleep(3600)  # until the test kills the process  # noqa: fixed-sleep

    def call(key: str) -> dict[str, int]:
        trace("call")
        if ctx.attempt == 1 and payload.block == "before_call":
            block()
        made = _provider_charge(key, payload.amount)
        if ctx.attempt == 1 and payload.block == "after_call":
            block()
        return made

    def reconcile(key: str) -> dict[str, int] | None:
        trace("reconcile")
        return _provider_lookup(key)

    return jobs.effect(ctx, "charge").run(call, reconcile=reconcile)


# -- many hosts: a load whose every handler run says which host ran it -----------------------


class HostWork(Payload, name="test.host_work.v1"):
    """Append ``start``/``end`` lines naming the host, pid, job and attempt to ``path``.

    Attempt 1 waits until the file ``gate`` exists, at most ``first_seconds`` (no gate: just
    that long); later attempts sleep ``seconds``. Each wait ends early when cancelled, and the
    end line says which (``ok`` or ``cancelled``) and when (``time.monotonic()``).
    """

    path: str
    seconds: float = 0.0
    first_seconds: float | None = None
    gate: str = ""


@job(
    HostWork,
    timeout=timedelta(seconds=120),
    max_attempts=10,
    backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=100)),
)
def host_work(payload: HostWork, ctx: JobContext) -> None:
    import socket

    who = f"{socket.gethostname()} {os.getpid()} {ctx.job_id} {ctx.attempt}"
    with open(payload.path, "a") as out:
        out.write(f"start {who} {time.monotonic():.3f}\n")
    if ctx.attempt == 1 and payload.first_seconds is not None:
        deadline = time.monotonic() + payload.first_seconds
        while not (payload.gate and os.path.exists(payload.gate)):
            if time.monotonic() >= deadline or ctx.sleep(0.01):
                break
    elif payload.seconds:
        ctx.sleep(payload.seconds)
    ended = "cancelled" if ctx.cancelled.is_set() else "ok"
    with open(payload.path, "a") as out:
        out.write(f"end {who} {time.monotonic():.3f} {ended}\n")
