"""The worker's run loop: each pass writes finished outcomes and claims for the free slots.

One control thread owns the loop and its own database connection::

    ┌─▶ outcomes due (the completer) ─┐  one statement, one commit (jobs.queue.record_and_claim)
    │   claim requests (the planner)  ─┘  (rotating over names, each within its concurrency)
    │   dispatch claimed jobs (the executor): sync ones to the handler pool, async ones to the
    │   event loop; settle the outcomes written (the completer)
    │   every second: expired leases; every maintenance interval: exhausted jobs
    │   (a pass that ends a job others wait for wakes the release thread: their release)
    └── wait for: a finished handler, a NOTIFY of new work, the poll interval
        (after a database error: a backoff from the poll interval, doubling, capped)

The loop composes the worker's parts, each in a module of its own: the claim planner
(:mod:`jobs.worker.planner`), the slot accounting (:mod:`jobs.worker.slots`), the outcome
completer (:mod:`jobs.worker.completer`), the executor (:mod:`jobs.worker.executor`) and its
hand-off heuristics (:mod:`jobs.worker.handoff`). The lease keeper renews held leases on its
own thread. On SIGTERM/SIGINT the worker drains (:mod:`jobs.worker.drain`). Outcomes already
decided are always flushed before exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from django.db import Error as DbError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from jobs import queue
from jobs.catalogue.registry import Registry
from jobs.db import bounds as dbbounds
from jobs.db.sqlstate import one_line, unreachable
from jobs.queue import ClaimedJob, ClaimRequest, Outcome, OutcomeReport
from jobs.runtime.process import install_stop_signals, restore_signals, start_http
from jobs.worker import metrics
from jobs.worker.completer import Completer, to_write
from jobs.worker.config import WorkerConfig
from jobs.worker.drain import Drain
from jobs.worker.execution import Running, run_rows
from jobs.worker.executor import Executor
from jobs.worker.leases import LeaseKeeper
from jobs.worker.maintenance import WorkerMaintenance
from jobs.worker.planner import ClaimPlanner
from jobs.worker.pool import HandlerPool
from jobs.worker.presence import worker_presence
from jobs.worker.release import DependentsRelease
from jobs.worker.settle import Settler, TerminalHook
from jobs.worker.slots import Slots
from jobs.worker.wakeup import NotifyListener

logger = logging.getLogger("jobs.worker")


class Worker:
    def __init__(
        self,
        registry: Registry,
        config: WorkerConfig | None = None,
        *,
        on_terminal_failure: TerminalHook | None = None,
    ) -> None:
        self.registry = registry
        self.config = config = config or WorkerConfig()
        self._on_terminal = on_terminal_failure
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._force = threading.Event()
        self.planner = ClaimPlanner(registry, config)
        # Whether any type served drives a bound run row (the queue moves it with the outcome).
        self._bound = any(registry[n].policy.run_model is not None for n in self.planner.names)
        self.slots = Slots(config.concurrency, prefetch=config.prefetch)
        settler = Settler(
            using=config.database,
            terminal=self._terminal,
            release=self._release_dependents,
            look_again_by=self.planner.look_again_by,
        )
        self.completer = Completer(config, self.slots, settler, self._stopping)
        self.executor = Executor(
            registry,
            config,
            self.slots,
            self.completer,
            stopping=self._stopping,
            wake=self._wake,
        )
        metrics.count_running(self)
        self._next_maintenance = 0.0
        self._next_recovery = 0.0
        self._retry_at = 0.0  # after a database error, no pass before this
        self._errors = 0  # consecutive failed passes
        self._maintenance = WorkerMaintenance(config, registry)
        self._listener: NotifyListener | None = None
        self._dependents: DependentsRelease | None = None
        self.ready = False
        self.alive_at = time.monotonic()

    # -- public ------------------------------------------------------------------------------

    def run(self, *, until: Callable[[Worker], bool] | None = None) -> int:
        """Run until stopped (or ``until(worker)`` is true after a loop pass); returns 0."""
        if self._connection.in_atomic_block:
            raise RuntimeError(
                "the worker cannot run inside a transaction: it must see committed jobs and "
                "commit its own claims (in tests use django_db(transaction=True))"
            )
        previous = install_stop_signals(self.request_stop, self.config.install_signal_handlers)
        pool = self.executor.pool = HandlerPool(self.config.concurrency)
        presence = worker_presence(self.config)
        keeper = LeaseKeeper(
            self.slots.snapshot,
            lease_seconds=self.config.lease_duration.total_seconds(),
            beat=lambda: presence.beat(held=self.slots.busy, draining=self._stopping.is_set()),
            beat_missed=presence.forget,
            using=self.config.database,
        )
        dependents = self._dependents = DependentsRelease(
            interval=self.config.recovery_interval, using=self.config.database
        )
        listener = self._listener = NotifyListener(
            self.planner.names,
            self._work_arrived,
            poll_interval=self.config.poll_interval,
            using=self.config.database,
        )
        server = start_http(
            self.config.http_host,
            self.config.http_port,
            healthy=lambda: self.healthy,
            ready=lambda: self.ready,
        )
        keeper.start()
        dependents.start()
        if self.config.notify_enabled and self.planner.names:
            listener.start()
        self._log_start()
        # The loop's own connection gets statement, lock and network bounds (jobs.db.bounds):
        # no call of the run loop may wait forever. Handler threads keep the plain settings.
        bounds = contextlib.ExitStack()
        bounds.enter_context(dbbounds.bounded(self._connection))
        try:
            presence.register()  # refused (no database yet): the keeper's next beat retries
            self.ready = True
            metrics.ready.set(1)
            while not self._stopping.is_set():
                self._wake.clear()
                self.alive_at = time.monotonic()
                self._pass()
                if until is not None and until(self):
                    break
                self._wake.wait(self._wait_time())
            self.ready = False
            metrics.ready.set(0)
            parts = (self.config, self.slots, self.completer)
            return Drain(*parts, loop_pass=self._pass, wake=self._wake, force=self._force).run()
        finally:
            self.ready = False
            metrics.ready.set(0)
            keeper.stop()
            dependents.stop()
            presence.unregister()  # a clean stop; kill -9 leaves the row to show as gone
            listener.stop()
            if server is not None:
                server.shutdown()
            pool.shutdown(timeout=0 if self._force.is_set() else 1.0)
            bounds.close()
            self._connection.close()
            restore_signals(previous)

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a graceful drain; with ``force`` (or a second call) skip waiting for handlers."""
        if force or self._stopping.is_set():
            self._force.set()
        self._stopping.set()
        self._wake.set()

    @property
    def idle(self) -> bool:
        """No job held and no outcome waiting to be written."""
        return self.slots.empty() and not self.completer.pending

    @property
    def handlers_running(self) -> int:
        """Handlers started and not finished (``jobs_worker_running`` reads it when scraped)."""
        return self.slots.running

    @property
    def listening(self) -> bool:
        """True while the NOTIFY listener is connected and has proved its LISTEN delivers."""
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
        except Exception as exc:
            self._loop_error(exc)
            return
        completer = self.completer
        acks, waiting = completer.take(now)
        try:
            self.planner.ensure_gates()
            self._throttle(acks)
            if any(r.contended for r, _ in acks):
                acks = completer.write_contended(acks)
        except Exception as exc:
            completer.put_back(acks)
            self._loop_error(exc)
            return
        # Slots freed by outcomes that wait for others are claimed in the pass that writes
        # those outcomes: a claim for each slot as it frees costs a pass a job.
        stopping = self._stopping.is_set()
        requests = [] if waiting or stopping else self.planner.requests(now, self.slots)
        if not acks and not requests:
            self._errors = 0
            completer.flush_history(now)  # an idle worker still writes what it counted
            return
        outcomes = to_write(acks)
        # A claim's lease begins on the server as its statement starts: by our clock, no
        # later than now (its answer may take long to come, and the pass to dispatch it).
        sent_at = time.monotonic()
        try:
            report, claimed = self._write_and_claim(outcomes, requests)
        except Exception as exc:  # a refused statement, an outage, or a bug: never fatal
            if unreachable(exc) or not outcomes:
                completer.put_back(acks)
                self._loop_error(exc)
                return
            try:
                report, outcomes = completer.write_alone(outcomes, exc)
            except Exception as exc:
                completer.put_back(acks)
                self._loop_error(exc)
                return
            claimed = []
        self._errors = 0
        completer.written(acks, outcomes, report)
        self.executor.dispatch(claimed, leased_at=sent_at)
        completer.flush_history(now)

    def _write_and_claim(
        self, outcomes: list[tuple[Running, Outcome]], requests: list[ClaimRequest]
    ) -> tuple[OutcomeReport | None, list[ClaimedJob]]:
        """Outcomes and the next claim together: one commit per loop pass
        (:func:`jobs.queue.record_and_claim`; the bound run rows of the outcomes move with
        them, in the same transaction)."""
        planner = self.planner
        free = self.slots.free()
        report, claimed = queue.record_and_claim(
            [o for _, o in outcomes],
            requests,
            scope=self.config.scope,
            limit=free,
            lease=self.config.lease_duration,
            worker=self.config.identity,
            count=False,
            limits=planner.limits,
            after=planner.cursors,
            runs=run_rows(r for r, _ in outcomes) if self._bound else None,
            using=self.config.database,
        )
        self.completer.counted(outcomes, report)
        if planner.claimed(requests, claimed, free):
            self._wake.set()
        return (report if outcomes else None), claimed

    def _throttle(self, acks: list[tuple[Running, Outcome | None]]) -> None:
        """Pause the types whose handlers said the upstream wants them slower (before the
        pass's claim, so it already holds); each only once."""
        for running, _ in acks:
            if running.throttle is None:
                continue
            delay, detail = running.throttle
            job = running.job
            until = queue.throttle(
                job.name,
                delay,
                reason=f"throttled by job {job.job_id}: {detail}"[:200],
                using=self.config.database,
            )
            running.throttle = None
            metrics.throttles.labels(job.name).inc()
            logger.warning(
                "job type %s throttled for %.1fs by job %s%s",
                job.name,
                delay,
                job.job_id,
                "" if until is not None else " (it is paused by an operator already)",
                extra={"job_id": job.job_id, "job_type": job.name, "action": "throttled"},
            )

    def _loop_error(self, exc: Exception) -> None:
        """Back off after a failed pass: poll interval, doubling, capped; one line a retry."""
        self._errors += 1
        delay = min(
            self.config.poll_interval * 2 ** min(self._errors - 1, 20),
            self.config.error_backoff_max,
        )
        self._retry_at = time.monotonic() + delay
        metrics.loop_errors.inc()
        logger.error(
            "%s in the run loop (%s); retry %d in %.1fs",
            "database error" if isinstance(exc, DbError) else "error",
            one_line(exc),
            self._errors,
            delay,
            # A traceback helps with a bug, not with an outage: once, and not for the network.
            exc_info=self._errors == 1 and not unreachable(exc),
            extra={"action": "loop_error", "retry": self._errors, "delay": delay},
        )
        with contextlib.suppress(Exception):
            self._connection.close()

    def _wait_time(self) -> float:
        now = time.monotonic()
        if now < self._retry_at:
            return self._retry_at - now
        waits = [
            self.planner.next_poll - now,
            self._next_maintenance - now,
            self._next_recovery - now,
        ]
        if self.slots.free() > 0:
            # A held-back type whose wait ran out during the pass is due now.
            waits.extend(self.planner.waits(now))
        waits.extend(self.completer.waits(now))
        return max(0.0, min(waits))

    def _work_arrived(self, name: str | None = None) -> None:
        """NOTIFY listener callback (another thread)."""
        self.planner.notice(name)
        self._wake.set()

    # -- maintenance -------------------------------------------------------------------------

    def _recover(self) -> None:
        if self._maintenance.recover():
            self.planner.recovered()  # requeued jobs are due now: claim them at once

    def _maintain(self) -> None:
        for row in self._maintenance.run_once():
            self._terminal(row.name, row.job_id, row.code, "failed by the exhaustion pass")

    def _terminal(self, name: str, job_id: str, code: str, detail: str) -> None:
        metrics.terminal_failures.labels(name, code).inc()
        if self._on_terminal is not None:
            self._on_terminal(name, job_id, code, detail)

    def _release_dependents(self) -> None:
        """A pass ended a job others wait for: the release thread releases them now."""
        if self._dependents is not None:
            self._dependents.wake()

    # -- process plumbing --------------------------------------------------------------------

    @property
    def _connection(self) -> BaseDatabaseWrapper:
        """The calling thread's connection to the worker's database (the run loop's own)."""
        return connections[self.config.database]

    def _log_start(self) -> None:
        logger.info(
            "worker %s started: database %s, %d slots, scope %s, types %s",
            self.config.identity,
            self.config.database,
            self.config.concurrency,
            self.config.scope,
            self.planner.described(),
            extra={"action": "started"},
        )
