"""The worker's run loop: capacity, claims, dispatch, batched outcomes, maintenance, drain.

One control thread owns the loop and its own database connection::

    ┌─▶ flush finished outcomes ─┐  one transaction, one commit
    │   claim up to free slots  ─┘  (rotating over names, each within its concurrency)
    │   dispatch claimed jobs to the handler pool
    │   every maintenance interval: expired leases, exhaustion, backlog gauges
    └── wait for: a finished handler, a NOTIFY of new work, the poll interval

Handlers run in a thread pool; the lease keeper renews held leases on its own thread. On the
first SIGTERM/SIGINT the loop stops claiming, reports not ready and waits up to the shutdown
timeout for running handlers; then it cancels the rest and hands their jobs back to the queue.
A second signal skips the wait. Outcomes already decided are always flushed before exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction

from jobs import dbbounds, queue
from jobs.process import install_stop_signals, restore_signals, start_http
from jobs.queue import ClaimedJob, ClaimRequest, Outcome, OutcomeReport
from jobs.registry import Registry
from jobs.runs import ErrorCode, RunState
from jobs.worker import metrics
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, execute, make_context, sync_run_rows
from jobs.worker.leases import LeaseKeeper
from jobs.worker.maintenance import WorkerMaintenance
from jobs.worker.pool import HandlerPool
from jobs.worker.wakeup import NotifyListener

logger = logging.getLogger("jobs.worker")

#: After a second stop signal, how long cancelled handlers still get to return (seconds).
FORCED_CANCEL_TIMEOUT = 1.0

#: Called with (job type name, job_id, error code, detail) when a job becomes failed.
TerminalHook = Callable[[str, str, str, str], None]


class Worker:
    def __init__(
        self,
        registry: Registry,
        config: WorkerConfig | None = None,
        *,
        on_terminal_failure: TerminalHook | None = None,
    ) -> None:
        self.registry = registry
        self.config = config or WorkerConfig()
        self._on_terminal = on_terminal_failure
        self._names = list(registry.names())
        self._lock = threading.Lock()
        self._held: dict[int, Running] = {}
        self._in_flight = 0
        self._in_flight_by_name: Counter[str] = Counter()
        self._acks: list[tuple[Running, Outcome | None]] = []
        self._first_ack_at: float | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._force = threading.Event()
        self._exhausted: set[str] = set()
        self._rotation = 0
        self._next_poll = 0.0
        self._next_maintenance = 0.0
        self._next_recovery = 0.0
        self._retry_at = 0.0  # after a database error, no pass before this
        self._errors = 0  # consecutive failed passes
        self._maintenance = WorkerMaintenance(self.config, registry)
        self._listener: NotifyListener | None = None
        self.ready = False
        self.alive_at = time.monotonic()

    # -- public ------------------------------------------------------------------------------

    def run(self, *, until: Callable[[Worker], bool] | None = None) -> int:
        """Run until stopped (or ``until(worker)`` is true after a loop pass); returns 0."""
        if connection.in_atomic_block:
            raise RuntimeError(
                "the worker cannot run inside a transaction: it must see committed jobs and "
                "commit its own claims (in tests use django_db(transaction=True))"
            )
        previous = install_stop_signals(self.request_stop, self.config.install_signal_handlers)
        pool = self._pool = HandlerPool(self.config.concurrency)
        keeper = LeaseKeeper(self._held_snapshot, lease_seconds=self._lease_seconds)
        listener = self._listener = NotifyListener(self._names, self._work_arrived)
        server = start_http(
            self.config.http_host,
            self.config.http_port,
            healthy=lambda: self.healthy,
            ready=lambda: self.ready,
        )
        keeper.start()
        if self.config.notify_enabled and self._names:
            listener.start()
        self._log_start()
        # The loop's own connection gets statement, lock and network bounds (jobs.dbbounds):
        # no call of the run loop may wait forever. Handler threads keep the plain settings.
        bounds = contextlib.ExitStack()
        bounds.enter_context(dbbounds.bounded(connection))
        try:
            self.ready = True
            metrics.ready.set(1)
            while not self._stopping.is_set():
                self._wake.clear()
                self.alive_at = time.monotonic()
                self._pass()
                if until is not None and until(self):
                    break
                self._wake.wait(self._wait_time())
            return self._drain()
        finally:
            self.ready = False
            metrics.ready.set(0)
            keeper.stop()
            listener.stop()
            if server is not None:
                server.shutdown()
            pool.shutdown(timeout=0 if self._force.is_set() else 1.0)
            bounds.close()
            connection.close()
            restore_signals(previous)

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a graceful drain; with ``force`` (or a second call) skip waiting for handlers."""
        if force or self._stopping.is_set():
            self._force.set()
        self._stopping.set()
        self._wake.set()

    @property
    def idle(self) -> bool:
        """No handler running and no outcome waiting to be written."""
        with self._lock:
            return not self._held and not self._acks

    @property
    def listening(self) -> bool:
        """True while the NOTIFY listener is connected and listening."""
        return self._listener is not None and self._listener.listening.is_set()

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self.alive_at < max(10.0, 4 * self.config.poll_interval)

    # -- the loop ----------------------------------------------------------------------------

    def _pass(self) -> None:
        now = time.monotonic()
        if now < self._retry_at:
            return  # backing off after a database error
        # Timers move first: a pass that keeps failing cannot starve outcomes and claims.
        try:
            if now >= self._next_recovery:
                self._next_recovery = now + self.config.recovery_interval
                self._recover()
            if now >= self._next_maintenance:
                self._next_maintenance = now + self.config.maintenance_interval
                self._maintain()
        except DatabaseError as exc:
            self._database_error(exc)
            return
        acks = self._take_acks(now)
        requests = self._claim_requests(now)
        if not acks and not requests:
            self._errors = 0
            return
        outcomes = [(r, o) for r, o in acks if o is not None and not r.lost]
        try:
            report, claimed = self._write_and_claim(outcomes, requests)
        except DatabaseError as exc:
            if not _refused_data(exc) or not outcomes:
                self._put_back(acks)
                self._database_error(exc)
                return
            # One outcome the database refused must not hold back the others: write them
            # one by one, and fail the one that still cannot be written.
            logger.warning(
                "the database refused a batch of %d outcomes (%s); writing them one by one",
                len(outcomes),
                _one_line(exc),
                extra={"action": "outcome_fallback"},
            )
            try:
                report, outcomes = self._write_one_by_one(outcomes)
            except DatabaseError as exc:
                self._put_back(acks)
                self._database_error(exc)
                return
            claimed = []
        self._errors = 0
        self._settle(acks, outcomes, report)
        self._dispatch(claimed)

    def _write_and_claim(
        self, outcomes: list[tuple[Running, Outcome]], requests: list[ClaimRequest]
    ) -> tuple[OutcomeReport | None, list[ClaimedJob]]:
        """Outcomes and the next claim in one transaction: one commit per loop pass."""
        with transaction.atomic():
            report = queue.record([o for _, o in outcomes]) if outcomes else None
            if report is not None:
                applied = set(report.applied)
                sync_run_rows([(r, o) for r, o in outcomes if r.job.id in applied])
            claimed = self._claim(requests) if requests else []
        return report, claimed

    def _write_one_by_one(
        self, outcomes: list[tuple[Running, Outcome]]
    ) -> tuple[OutcomeReport, list[tuple[Running, Outcome]]]:
        """Each outcome in its own transaction; one the database refuses becomes a failure.

        Returns the report and the outcomes as written (a refused one replaced).
        """
        applied: list[int] = []
        fenced: list[int] = []
        written: list[tuple[Running, Outcome]] = []
        for running, outcome in outcomes:
            job = running.job
            try:
                ok = self._write_one(running, outcome)
            except DatabaseError as exc:
                if not _refused_data(exc):
                    raise
                logger.error(
                    "the database refused the outcome of job %s (%s): %s; failing the job",
                    job.job_id,
                    job.name,
                    _one_line(exc),
                    extra={"job_id": job.job_id, "job_type": job.name, "action": "refused"},
                )
                outcome = Outcome.failed(
                    job,
                    code=ErrorCode.HANDLER_ERROR,
                    detail=f"the database refused this attempt's outcome ({outcome.state}): "
                    f"{_one_line(exc)}",
                )
                try:
                    ok = self._write_one(running, outcome)
                except DatabaseError as again:
                    if not _refused_data(again):
                        raise
                    # Not even the failure could be stored: let the lease expire.
                    logger.error("could not fail job %s either: %s", job.job_id, again)
                    running.lost = True
                    continue
            (applied if ok else fenced).append(job.id)
            written.append((running, outcome))
        return OutcomeReport(tuple(applied), tuple(fenced)), written

    def _write_one(self, running: Running, outcome: Outcome) -> bool:
        with transaction.atomic():
            report = queue.record([outcome])
            if report.applied:
                sync_run_rows([(running, outcome)])
        return bool(report.applied)

    def _database_error(self, exc: DatabaseError) -> None:
        """Back off after a failed pass: poll interval, doubling, capped; one line a retry."""
        self._errors += 1
        delay = min(
            self.config.poll_interval * 2 ** min(self._errors - 1, 20),
            self.config.error_backoff_max,
        )
        self._retry_at = time.monotonic() + delay
        metrics.loop_errors.inc()
        logger.error(
            "database error in the run loop (%s); retry %d in %.1fs",
            _one_line(exc),
            self._errors,
            delay,
            # A traceback helps with a bug, not with an outage: once, and not for the network.
            exc_info=self._errors == 1 and _refused_data(exc),
            extra={"action": "loop_error", "retry": self._errors, "delay": delay},
        )
        with contextlib.suppress(Exception):
            connection.close()

    def _take_acks(self, now: float) -> list[tuple[Running, Outcome | None]]:
        with self._lock:
            if not self._acks:
                return []
            free = self.config.concurrency - self._in_flight
            due = (
                self._stopping.is_set()
                or self._in_flight == 0
                or free >= max(1, self.config.concurrency // 2)
                or now - (self._first_ack_at or now) >= self.config.ack_interval
            )
            if not due:
                return []
            acks, self._acks, self._first_ack_at = self._acks, [], None
            return acks

    def _put_back(self, acks: list[tuple[Running, Outcome | None]]) -> None:
        with self._lock:
            self._acks[:0] = acks
            self._first_ack_at = self._first_ack_at or time.monotonic()

    def _claim_requests(self, now: float) -> list[ClaimRequest]:
        if self._stopping.is_set() or not self._names:
            return []
        if now >= self._next_poll:
            self._exhausted.clear()
            self._next_poll = now + self.config.poll_interval
        with self._lock:
            free = self.config.concurrency - self._in_flight
            running = dict(self._in_flight_by_name)
        if free <= 0:
            return []
        count = len(self._names)
        self._rotation = (self._rotation + 1) % count
        requests = []
        for name in self._names[self._rotation :] + self._names[: self._rotation]:
            if name in self._exhausted:
                continue
            policy = self.registry[name].policy
            room = min(free, policy.concurrency - running.get(name, 0))
            if room > 0:
                requests.append(ClaimRequest(name, room, policy.max_attempts))
        return requests

    def _claim(self, requests: list[ClaimRequest]) -> list[ClaimedJob]:
        with self._lock:
            free = self.config.concurrency - self._in_flight
        claimed = queue.claim(
            requests,
            scope=self.config.scope,
            limit=free,
            lease=self.config.lease_duration,
            worker=self.config.identity,
        )
        got = Counter(job.name for job in claimed)
        if len(claimed) < free:
            # A name that gave fewer jobs than asked has nothing more due right now; skip it
            # until a NOTIFY for it or the next poll.
            self._exhausted.update(r.name for r in requests if got[r.name] < r.limit)
        return claimed

    def _dispatch(self, claimed: list[ClaimedJob]) -> None:
        for job in claimed:
            job_type = self.registry[job.name]
            running = Running(job, job_type, make_context(job, job_type))
            with self._lock:
                self._held[job.id] = running
                self._in_flight += 1
                self._in_flight_by_name[job.name] += 1
            type_metrics = metrics.for_type(job.name)
            type_metrics.claimed.inc()
            type_metrics.queue_latency.observe(job.latency)
            metrics.running.inc()
            self._pool.submit(partial(self._execute, running))

    def _execute(self, running: Running) -> None:
        """Runs on a handler thread. Whatever happens in it, the slot is freed."""
        with self._lock:
            if running.handed_back:
                return  # a drain released the job before this thread took it
            running.started = True
        outcome: Outcome | None = None
        try:
            outcome = execute(
                running, shutting_down=self._stopping.is_set, lease=self.config.lease_duration
            )
        except BaseException as exc:  # a bug of ours must not leak the slot
            logger.exception("worker error running job %s", running.job.job_id)
            if not running.lost:
                outcome = Outcome.retry(
                    running.job,
                    code=ErrorCode.HANDLER_ERROR,
                    detail=f"the worker failed running the job: {_one_line(exc)}",
                    delay=running.job_type.policy.resolved_backoff().delay(running.ctx.attempt),
                )
        finally:
            self._finished(running, outcome)

    def _finished(self, running: Running, outcome: Outcome | None) -> None:
        with self._lock:
            running.finished = True
            self._in_flight -= 1
            self._in_flight_by_name[running.job.name] -= 1
            self._acks.append((running, outcome))
            if self._first_ack_at is None:
                self._first_ack_at = time.monotonic()
        metrics.running.dec()
        self._wake.set()

    def _settle(self, acks, outcomes, report) -> None:
        fenced = set(report.fenced) if report else set()
        with self._lock:
            for running, _ in acks:
                self._held.pop(running.job.id, None)
        for running, outcome in outcomes:
            job = running.job
            if job.id in fenced:
                metrics.fenced_outcomes.labels(job.name).inc()
                logger.warning(
                    "outcome of job %s (%s) discarded: this worker no longer holds it",
                    job.job_id,
                    job.name,
                    extra={"job_id": job.job_id, "job_type": job.name, "action": "fenced"},
                )
                continue
            self._log_outcome(running, outcome)

    def _log_outcome(self, running: Running, outcome: Outcome) -> None:
        job = running.job
        if outcome.attempts_delta < 0:  # handed back by a drain after its handler returned
            metrics.released.labels(job.name).inc()
            logger.warning(
                "handed back job %s (%s): its handler returned after being cancelled",
                job.job_id,
                job.name,
                extra={"job_id": job.job_id, "job_type": job.name, "action": "released"},
            )
            return
        kind = {RunState.SUCCEEDED: "succeeded", RunState.FAILED: "failed"}.get(
            outcome.state, "retried"
        )
        metrics.for_type(job.name).outcome(kind).inc()
        if kind == "succeeded" and not logger.isEnabledFor(logging.DEBUG):
            return
        duration = time.monotonic() - running.claimed_at
        extra = {
            "job_id": job.job_id,
            "job_type": job.name,
            "tenant": job.tenant,
            "attempt": running.ctx.attempt,
            "outcome": kind,
            "code": outcome.code or "",
            "duration": round(duration, 6),
            "action": "outcome",
        }
        if kind == "succeeded":
            logger.debug("job %s (%s) succeeded", job.job_id, job.name, extra=extra)
            return
        logger.warning(
            "job %s (%s) %s: %s",
            job.job_id,
            job.name,
            "failed" if kind == "failed" else "will retry",
            outcome.code,
            extra=extra,
        )
        if kind == "failed":
            self._terminal(job.name, job.job_id, outcome.code or "", outcome.detail or "")

    def _terminal(self, name: str, job_id: str, code: str, detail: str) -> None:
        metrics.terminal_failures.labels(name, code).inc()
        if self._on_terminal is not None:
            self._on_terminal(name, job_id, code, detail)

    def _wait_time(self) -> float:
        now = time.monotonic()
        if now < self._retry_at:
            return self._retry_at - now
        waits = [self._next_poll - now, self._next_maintenance - now, self._next_recovery - now]
        with self._lock:
            if self._first_ack_at is not None:
                waits.append(self._first_ack_at + self.config.ack_interval - now)
        return max(0.0, min(waits))

    def _work_arrived(self, name: str | None = None) -> None:
        """NOTIFY listener callback (another thread)."""
        if name is None:
            self._exhausted.clear()
        else:
            self._exhausted.discard(name)
        self._wake.set()

    # -- maintenance -------------------------------------------------------------------------

    def _recover(self) -> None:
        if self._maintenance.recover():
            self._exhausted.clear()  # requeued jobs are due now: claim them at once

    def _maintain(self) -> None:
        for row in self._maintenance.run_once():
            self._terminal(row.name, row.job_id, row.code, "failed by the exhaustion pass")

    # -- drain -------------------------------------------------------------------------------

    def _drain(self) -> int:
        """Stop claiming, let handlers finish, then cancel and hand back what is left.

        A job is handed back only once no handler of this worker runs it: its handler
        returned after being cancelled, or never started. A handler that ignores its
        cancellation past the cancel timeout keeps its lease when the process exits, so no
        other worker runs the job until that lease expires (``lease_expired``).
        """
        self.ready = False
        metrics.ready.set(0)
        busy = self._busy()
        if busy:
            logger.info(
                "draining: waiting up to %gs for %d running jobs",
                self.config.shutdown_timeout,
                busy,
                extra={"action": "drain"},
            )
        self._flush_until(time.monotonic() + self.config.shutdown_timeout, until_forced=True)
        self._cancel_leftovers()
        self._flush_until(time.monotonic() + self._cancel_grace)
        self._abandon_leftovers()
        logger.info("worker stopped", extra={"action": "stopped"})
        return 0

    @property
    def _cancel_grace(self) -> float:
        """A second signal skips the shutdown wait and shortens this one to a second."""
        if self._force.is_set():
            return min(self.config.cancel_timeout, FORCED_CANCEL_TIMEOUT)
        return self.config.cancel_timeout

    def _busy(self) -> int:
        with self._lock:
            return self._in_flight

    def _flush_until(self, deadline: float, *, until_forced: bool = False) -> None:
        """Write outcomes as handlers finish, until none runs or the deadline passes.

        With ``until_forced``, a second stop signal also ends the wait.
        """
        while not (until_forced and self._force.is_set()):
            self._wake.clear()
            self._pass()
            with self._lock:
                if self._in_flight == 0 and not self._acks:
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(remaining, max(self.config.ack_interval, 0.05)))

    def _cancel_leftovers(self) -> None:
        """Ask running handlers to stop; release jobs no handler thread has taken."""
        with self._lock:
            unstarted = []
            for running in self._held.values():
                if running.finished or running.lost:
                    continue
                if running.started:
                    running.shutdown = True
                    running.ctx.cancelled.set()
                else:
                    running.handed_back = True
                    unstarted.append(running)
            for running in unstarted:
                self._held.pop(running.job.id, None)
                self._in_flight -= 1
                self._in_flight_by_name[running.job.name] -= 1
                metrics.running.dec()
        cancelled = self._busy()
        if cancelled:
            logger.warning(
                "cancelled %d running handlers; waiting up to %gs for them to return",
                cancelled,
                self._cancel_grace,
                extra={"action": "cancel"},
            )
        if unstarted:
            self._release(unstarted)

    def _release(self, handed: list[Running]) -> None:
        try:
            with transaction.atomic():
                report = queue.release([r.job for r in handed])
                applied = set(report.applied)
                sync_run_rows([(r, Outcome.released(r.job)) for r in handed if r.job.id in applied])
        except DatabaseError:
            logger.exception("could not release jobs at shutdown; their leases will expire")
            return
        for running in handed:
            metrics.released.labels(running.job.name).inc()
        logger.warning(
            "handed back %d unfinished jobs: ids %s",
            len(report.applied),
            list(report.applied),
            extra={"action": "released"},
        )

    def _abandon_leftovers(self) -> None:
        """Handlers still running at exit keep their leases: never release a running job."""
        with self._lock:
            stuck = [r for r in self._held.values() if not r.finished and not r.lost]
            for running in stuck:
                running.lost = True
        if stuck:
            logger.error(
                "%d handlers did not stop after cancellation; their jobs keep their leases and "
                "run again after those expire (lease_expired): ids %s",
                len(stuck),
                [r.job.id for r in stuck],
                extra={"action": "abandoned"},
            )

    # -- process plumbing --------------------------------------------------------------------

    @property
    def _lease_seconds(self) -> float:
        return self.config.lease_duration.total_seconds()

    def _held_snapshot(self) -> list[Running]:
        with self._lock:
            return list(self._held.values())

    def _log_start(self) -> None:
        logger.info(
            "worker %s started: %d slots, scope %s, types %s",
            self.config.identity,
            self.config.concurrency,
            self.config.scope,
            ", ".join(self._names) or "(none)",
            extra={"action": "started"},
        )


def _refused_data(exc: DatabaseError) -> bool:
    """True when the database refused what was sent, rather than being unreachable."""
    return not isinstance(exc, OperationalError | InterfaceError)


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
