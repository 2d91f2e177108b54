"""The worker's run loop: capacity, claims, dispatch, batched outcomes, maintenance, drain.

One control thread owns the loop and its own database connection::

    ┌─▶ flush finished outcomes ─┐  one statement, one commit (jobs.queue.record_and_claim)
    │   claim up to free slots  ─┘  (rotating over names, each within its concurrency)
    │   dispatch claimed jobs: sync ones to the handler pool, async ones to the event loop
    │   every second: expired leases; every maintenance interval: exhausted jobs
    │   (a pass that ends a job others wait for wakes the release thread: their release)
    └── wait for: a finished handler, a NOTIFY of new work, the poll interval
        (after a database error: a backoff from the poll interval, doubling, capped)

Sync handlers run in a thread pool, async ones as tasks on the worker's event loop; the lease
keeper renews held leases on its own thread. A
refused outcome batch is written one by one (:mod:`jobs.worker.flush`). On SIGTERM/SIGINT
the worker drains (:mod:`jobs.worker.drain`). Outcomes already decided are always flushed
before exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial
from uuid import UUID

from django.db import Error as DbError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from jobs import queue
from jobs.api.effects import completed_by_handler
from jobs.catalogue import routing as databases
from jobs.catalogue.registry import Registry
from jobs.db import bounds as dbbounds
from jobs.db.sqlstate import one_line, unreachable
from jobs.queue import ClaimedJob, ClaimRequest, Outcome, OutcomeReport, flow
from jobs.runs import ErrorCode, RunState
from jobs.runtime.process import install_stop_signals, restore_signals, start_http
from jobs.worker import metrics
from jobs.worker.config import WorkerConfig
from jobs.worker.drain import Draining
from jobs.worker.execution import (
    Running,
    execute,
    failure_outcome,
    make_context,
    run_rows,
)
from jobs.worker.flush import write_one_by_one
from jobs.worker.history import History
from jobs.worker.leases import LeaseKeeper, with_last_report
from jobs.worker.maintenance import WorkerMaintenance
from jobs.worker.on_loop import execute_on_loop
from jobs.worker.pool import HandlerPool
from jobs.worker.presence import worker_presence
from jobs.worker.release import DependentsRelease
from jobs.worker.wakeup import NotifyListener

logger = logging.getLogger("jobs.worker")

# The outcome label of jobs_outcomes_total for a state an attempt ended in (else "retried").
_OUTCOME_KINDS: dict[str, str] = {
    RunState.SUCCEEDED: "succeeded",
    RunState.FAILED: "failed",
    RunState.CANCELLED: "cancelled",
}

#: Called with (job type name, job_id, error code, detail) when a job becomes failed.
TerminalHook = Callable[[str, str, str, str], None]

#: A NOTIFY brings a held-back limited type's next try forward to this long after its last.
NOTICE_RETRY = 0.1

#: An outcome whose row another session holds locked waits and is retried; this many tries
#: in a row, and the worker warns (one try is usually its own lease renewal, a moment's lock).
BUSY_WARN_AFTER = 3
#: After this many busy tries in a row, such an outcome is written alone, with a short wait
#: for the lock (jobs.worker.flush): a pass statement skips locked rows and never waits, and
#: a batch whose row siblings' passes keep taking would otherwise keep finding it held.
CONTENDED_AFTER = 2
#: The first retry of such an outcome comes this long after (seconds), each next one twice as
#: long after, up to the poll interval. The lock is mostly held for a moment: by the worker's
#: own lease renewal, or by another worker's claim, which locks a row it read as queued and
#: found claimed meanwhile until its statement ends. Waiting a poll interval each time held
#: the last jobs of a two-worker drain running for half a second.
BUSY_RETRY = 0.005

#: Prefetched jobs wait for a handler thread about this long at most: beyond its threads the
#: worker holds only as many jobs as they finish in this time, by the mean run time of its
#: recent thread-run handlers (seconds). Long handlers get no prefetch, so a worker busy with
#: them does not sit on jobs another worker could start.
PREFETCH_HORIZON = 0.02
# Weight of the latest run time in that mean.
_RUN_TIME_WEIGHT = 0.2

#: Outcomes of fewer slots than this, half the worker's, wait for the other half when those
#: should be done within ack_interval: a pass costs PostgreSQL about 0.4 ms whatever its size,
#: and with 10 slots of short handlers, passes of 5 halved the drain.
SMALL_PASS = 16

#: A pass's thread-run jobs are handed to as many sleeping threads as start them all within
#: about this long (seconds), by how long recent handlers held their thread: a thread woken
#: costs more than a short job, and the threads woken take the other jobs in turn (jobs that
#: nobody takes get more threads within the pool's STALL_AFTER).
HANDOFF_HORIZON = 0.002
#: A handler whose run took less than this longer than its thread's CPU time counts by its
#: CPU time: the difference is mostly waiting for the interpreter's lock while other
#: threads ran (seconds). Counted in full, such waits would wake more threads for the next
#: pass, which wait for each other more: short handlers in a busy worker would keep it busy
#: switching threads. A longer difference is a handler waiting on I/O, counted in full.
BLOCKED = 0.005


#: A handler thread reads its CPU clock for a job (for :func:`thread_held`) only when this
#: long has passed since it last did, or after a job that ran this long (seconds). The read
#: is a system call that takes the scheduler's lock: once a job, it was about 5 % of a busy
#: worker's CPU with jobs of microseconds. A job that ran this long makes its thread measure
#: the next one, so handlers that wait on I/O keep being measured (the hand-off goes by the
#: shortest of the recent ones).
CPU_SAMPLE_INTERVAL = 0.01


#: The hand-off goes by the shortest of this many recent handlers' times: a handler held up
#: for a moment (a turn at the CPU or at the interpreter's lock it waited for, longer than
#: BLOCKED on a busy machine) would otherwise wake threads for the next pass that wait for each
#: other in turn. Handlers that wait on I/O all take long, and so does the shortest of them.
RECENT_RUNS = 32


def thread_held(ran: float, cpu: float) -> float:
    """How long a handler that ran ``ran`` seconds, ``cpu`` of them on the CPU, counts as
    holding its thread for the hand-off (see :data:`BLOCKED`)."""
    return cpu if ran - cpu < BLOCKED else ran


def _threads_to_wake(jobs: int, run_time: float | None) -> int:
    """How many sleeping handler threads to wake for ``jobs`` thread-run jobs: before any
    has run, one, and the pool's stall watch wakes more while jobs wait (a first batch of
    short jobs on a thread each would wait for each other's turns at the interpreter's lock,
    and count those waits as their run time)."""
    if run_time is None:
        return 1
    return max(1, min(jobs, math.ceil(jobs * run_time / HANDOFF_HORIZON)))


class Worker(Draining):
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
        # The types bound to this worker's database and the unbound ones (jobs.catalogue.routing).
        self._names = list(databases.served(registry, self.config.database))
        # Whether any of them drives a bound run row (the queue moves it with the outcome).
        self._bound = any(registry[name].policy.run_model is not None for name in self._names)
        # Flow controls held by the claim (jobs.queue.flow): each type's limits, its gate row
        # made once, each tenant-ordered type's cursor, and when a type held back by its
        # limits is worth another try (with the streak of empty tries that set it).
        self._limits = {
            name: limits
            for name in self._names
            if (limits := flow.limits_of(registry[name].policy)) is not None
        }
        self._gates_made = not self._limits
        self._cursors: dict[str, str] = {}
        self._held_back: dict[str, tuple[float, int, float]] = {}  # (next try, empty tries, last)
        self._lock = threading.Lock()
        # Keyed by (id, claim token): after a stall the worker may hold a stale attempt and a
        # fresh claim of the same job at once, and each must be settled on its own.
        self._held: dict[tuple[int, UUID], Running] = {}
        self._in_flight = 0
        self._in_flight_by_name: Counter[str] = Counter()
        # Handlers started and not finished (jobs_worker_running reads it when scraped). At
        # most ``concurrency``: a held job that finds every slot taken at its start waits in
        # _waiting (both kinds, in order) until a handler ends (see _slot_taken).
        self.handlers_running = 0
        self._waiting: deque[Running] = deque()
        self._resuming = threading.local()  # jobs _resume starts on this thread, in turn
        metrics.count_running(self)
        self._acks: list[tuple[Running, Outcome | None]] = []
        # Outcomes whose row was locked by another session, retried from _deferred_at on.
        self._deferred: list[tuple[Running, Outcome | None]] = []
        self._history = History(using=self.config.database)
        self._history_failing = False
        self._deferred_at = 0.0
        self._first_ack_at: float | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._force = threading.Event()
        self._exhausted: set[str] = set()
        self._mean_run: float | None = None  # seconds, thread-run handlers; None: none yet
        # How long recent handlers held their thread (thread_held), and the shortest of
        # them, read once a pass (the hand-off and the wait for a pass's stragglers).
        self._recent_held: deque[float] = deque(maxlen=RECENT_RUNS)
        # Each handler thread's CPU clock at its last read, and its last job's run time.
        self._thread_cpu = threading.local()
        self._held_run: float | None = None
        # Names a NOTIFY announced since the last claim was sent (None: any name): such a
        # claim may have read before that commit, so its coming up short proves nothing.
        self._noticed: set[str | None] = set()
        self._shared: set[str] = set()  # names the last claim held below their own room
        self._rotation = 0
        self._next_poll = 0.0
        self._next_maintenance = 0.0
        self._next_recovery = 0.0
        self._retry_at = 0.0  # after a database error, no pass before this
        self._errors = 0  # consecutive failed passes
        self._maintenance = WorkerMaintenance(self.config, registry)
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
        pool = self._pool = HandlerPool(self.config.concurrency)
        presence = worker_presence(self.config)
        keeper = LeaseKeeper(
            self._held_snapshot,
            lease_seconds=self._lease_seconds,
            beat=lambda: presence.beat(held=self._busy(), draining=self._stopping.is_set()),
            beat_missed=presence.forget,
            using=self.config.database,
        )
        dependents = self._dependents = DependentsRelease(
            interval=self.config.recovery_interval, using=self.config.database
        )
        listener = self._listener = NotifyListener(
            self._names,
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
        if self.config.notify_enabled and self._names:
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
            return self._drain()
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
        """No handler running and no outcome waiting to be written."""
        with self._lock:
            return not self._held and not self._acks and not self._deferred

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
        acks, waiting = self._take_acks(now)
        try:
            if not self._gates_made:
                flow.ensure(self._limits, using=self.config.database)
                self._gates_made = True
            self._throttle(acks)
        except Exception as exc:
            self._put_back(acks)
            self._loop_error(exc)
            return
        if any(r.contended for r, _ in acks):
            rest = self._write_contended(acks)
            if rest is None:
                return
            acks = rest
        # Slots freed by outcomes that wait for others are claimed in the pass that writes
        # those outcomes: a claim for each slot as it frees costs a pass a job.
        requests = [] if waiting else self._claim_requests(now)
        if not acks and not requests:
            self._errors = 0
            self._flush_history(now)  # an idle worker still writes what it counted
            return
        outcomes = [(r, o) for r, o in acks if o is not None and not r.lost]
        # A claim's lease begins on the server as its statement starts: by our clock, no
        # later than now (its answer may take long to come, and the pass to dispatch it).
        sent_at = time.monotonic()
        try:
            report, claimed = self._write_and_claim(outcomes, requests)
        except Exception as exc:  # a refused statement, an outage, or a bug: never fatal
            if unreachable(exc) or not outcomes:
                self._put_back(acks)
                self._loop_error(exc)
                return
            # One outcome the database refused must not hold back the others: write them
            # one by one, and fail the one that still cannot be written.
            logger.warning(
                "the database refused a batch of %d outcomes (%s); writing them one by one",
                len(outcomes),
                one_line(exc),
                extra={"action": "outcome_fallback"},
            )
            try:
                report, outcomes = write_one_by_one(outcomes)
            except Exception as exc:
                self._put_back(acks)
                self._loop_error(exc)
                return
            claimed = []
        self._errors = 0
        if report is not None and report.busy:
            acks, outcomes = self._defer_busy(acks, outcomes, report.busy_tokens)
        self._settle(acks, outcomes, report)
        self._dispatch(claimed, leased_at=sent_at)
        self._flush_history(now)

    def _write_contended(
        self, acks: list[tuple[Running, Outcome | None]]
    ) -> list[tuple[Running, Outcome | None]] | None:
        """Write the outcomes that met contention before, each alone with a short lock wait,
        so a lock still held defers them again without holding up the pass statement.

        Returns the other acks, for the pass; None after a database outage (all put back).
        """
        mine = [(r, o) for r, o in acks if r.contended]
        rest = [(r, o) for r, o in acks if not r.contended]
        outcomes = [(r, o) for r, o in mine if o is not None and not r.lost]
        try:
            report, outcomes = write_one_by_one(outcomes)
        except Exception as exc:
            self._put_back(acks)
            self._loop_error(exc)
            return None
        if report.busy:
            mine, outcomes = self._defer_busy(mine, outcomes, report.busy_tokens)
        self._settle(mine, outcomes, report)
        return rest

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

    def _flush_history(self, now: float | None = None, *, final: bool = False) -> None:
        """Add the counted attempts to the console's history (about once a second, and at a
        clean stop). A failure is logged once per streak and never stops the loop."""
        try:
            self._history.flush(now=now, force=final)
        except Exception as exc:
            if not self._history_failing or final:
                logger.warning(
                    "could not write the console's history (%s); %d attempts wait for the next try",
                    one_line(exc),
                    self._history.held,
                    extra={"action": "history_failed"},
                )
            self._history_failing = True
        else:
            self._history_failing = False

    def _defer_busy(
        self,
        acks: list[tuple[Running, Outcome | None]],
        outcomes: list[tuple[Running, Outcome]],
        busy: frozenset[UUID],
    ) -> tuple[list[tuple[Running, Outcome | None]], list[tuple[Running, Outcome]]]:
        """Outcomes whose row another session holds locked are written again soon: after
        :data:`BUSY_RETRY`, twice as long at each try in a row, up to the poll interval."""
        waiting = [(r, o) for r, o in acks if o is not None and o.token in busy]
        for running, _ in waiting:
            running.busy_passes += 1
            if running.busy_passes >= CONTENDED_AFTER:
                # Not a moment's lock (the worker's own renewal): written alone from now on,
                # waiting for the lock a little (its batch's row, held by a sibling's pass).
                running.contended = True
            logger.log(
                logging.WARNING if running.busy_passes == BUSY_WARN_AFTER else logging.DEBUG,
                "outcome of job %s (%s) waits (try %d): another session holds its row locked",
                running.job.job_id,
                running.job.name,
                running.busy_passes,
                extra={"job_id": running.job.job_id, "action": "outcome_busy"},
            )
        tries = min((running.busy_passes for running, _ in waiting), default=1)
        delay = min(self.config.poll_interval, BUSY_RETRY * 2 ** min(tries - 1, 16))
        with self._lock:
            self._deferred.extend(waiting)
            self._deferred_at = time.monotonic() + delay
        keep = [(r, o) for r, o in acks if o is None or o.token not in busy]
        return keep, [(r, o) for r, o in outcomes if o.token not in busy]

    def _write_and_claim(
        self, outcomes: list[tuple[Running, Outcome]], requests: list[ClaimRequest]
    ) -> tuple[OutcomeReport | None, list[ClaimedJob]]:
        """Outcomes and the next claim together: one commit per loop pass
        (:func:`jobs.queue.record_and_claim`; the bound run rows of the outcomes move with
        them, in the same transaction)."""
        with self._lock:
            free = self._capacity() - self._in_flight
        report, claimed = queue.record_and_claim(
            [o for _, o in outcomes],
            requests,
            scope=self.config.scope,
            limit=free,
            lease=self.config.lease_duration,
            worker=self.config.identity,
            count=False,
            limits=self._limits,
            after=self._cursors,
            runs=run_rows(r for r, _ in outcomes) if self._bound else None,
            using=self.config.database,
        )
        self._history.count(outcomes, report)
        self._note_claimed(requests, claimed, free)
        return (report if outcomes else None), claimed

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

    def _take_acks(self, now: float) -> tuple[list[tuple[Running, Outcome | None]], bool]:
        """The outcomes to write now, if they are due, and whether others wait to be."""
        with self._lock:
            if self._deferred and now >= self._deferred_at:
                self._acks.extend(self._deferred)
                self._deferred = []
                self._first_ack_at = self._first_ack_at or now
            if not self._acks:
                return [], False
            if not self._acks_due(now):
                return [], True
            acks, self._acks, self._first_ack_at = self._acks, [], None
            return acks, False

    def _acks_due(self, now: float) -> bool:
        """Whether the outcomes waiting are to be written now (called under ``self._lock``):
        when the worker stops or is idle, when half its slots are free (and, for fewer than
        :data:`SMALL_PASS`, the rest will not be done soon), or once the first has waited
        ``ack_interval``."""
        capacity = self._capacity()
        free = capacity - self._in_flight
        if self._stopping.is_set() or self._in_flight == 0:
            return True
        if now - (self._first_ack_at or now) >= self.config.ack_interval:
            return True
        if free < max(1, capacity // 2):
            return False
        # Half the slots are free. A pass for a few of them costs about as much as one for
        # all: when the rest should be done in a moment, wait for them (ack_interval at most).
        return free >= SMALL_PASS or not self._finishing_soon()

    def _finishing_soon(self) -> bool:
        """Whether the handlers running now should all be done within ``ack_interval``, by how
        long recent handlers held their thread (called under ``self._lock``)."""
        held = self._held_run
        return held is not None and self._in_flight * held < self.config.ack_interval

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
            free = self._capacity() - self._in_flight
            idle = self.config.concurrency - self._in_flight  # async jobs start at once
            running = dict(self._in_flight_by_name)
        if free <= 0:
            return []
        count = len(self._names)
        self._rotation = (self._rotation + 1) % count
        rooms = []
        for name in self._names[self._rotation :] + self._names[: self._rotation]:
            held = self._held_back.get(name)
            if held is not None and held[0] != math.inf:
                if held[0] > now:
                    continue
                # Its wait is over: tried now (the claim's result sets the next wait), and no
                # longer a reason for the loop to wake.
                self._held_back[name] = (math.inf, held[1], held[2])
            if name in self._exhausted:
                continue
            job_type = self.registry[name]
            policy = job_type.policy
            # Not prefetched: a job under a fleet-wide limit or rate, which counts against
            # it from its claim. (Fair order alone is decided at the claim too; holding a job
            # a few ms more does not change it.)
            limits = self._limits.get(name)
            prefetched = limits is None or not limits.gated
            room = free if prefetched else min(free, idle)
            if policy.concurrency is not None:
                room = min(room, policy.concurrency - running.get(name, 0))
            if room > 0:
                rooms.append((name, room, policy.max_attempts))
        # The free slots are shared among the names that want them, so one type with a large
        # (or no) limit cannot take every slot while another waits; the rotation decides who
        # gets the remainder. Slots a name leaves unused go round again at once (see _claim).
        share = -(-free // len(rooms)) if rooms else 0
        self._shared = {name for name, room, _ in rooms if room > share}
        with self._lock:
            self._noticed.clear()  # the claim these requests are for reads after this
        return [ClaimRequest(name, min(room, share), cap) for name, room, cap in rooms]

    def _claim(self, requests: list[ClaimRequest]) -> list[ClaimedJob]:
        with self._lock:
            free = self._capacity() - self._in_flight
        claimed = queue.claim(
            requests,
            scope=self.config.scope,
            limit=free,
            lease=self.config.lease_duration,
            worker=self.config.identity,
            limits=self._limits,
            after=self._cursors,
            using=self.config.database,
        )
        self._note_claimed(requests, claimed, free)
        return claimed

    def _note_claimed(
        self, requests: list[ClaimRequest], claimed: list[ClaimedJob], free: int
    ) -> None:
        got = Counter(job.name for job in claimed)
        if self._limits:
            self._note_flow(requests, claimed, got)
            requests = [r for r in requests if r.name not in self._limits]
        if len(claimed) < free:
            # A name that gave fewer jobs than asked has nothing more due right now; skip it
            # until a NOTIFY for it or the next poll. Not if a NOTIFY for it came while the
            # claim ran: the claim may have read before that job's commit.
            with self._lock:
                noticed = set(self._noticed)
            if None not in noticed:
                self._exhausted.update(
                    r.name for r in requests if got[r.name] < r.limit and r.name not in noticed
                )
            if any(got[r.name] >= r.limit for r in requests if r.name in self._shared):
                self._wake.set()  # a name held to its share may take the slots left over

    def _note_flow(
        self, requests: list[ClaimRequest], claimed: list[ClaimedJob], got: Counter[str]
    ) -> None:
        """Move tenant cursors on; hold back a limited type that gave fewer jobs than asked.

        A limited type can come up short with jobs due (its limit had no room, or another
        worker held its gate), and no NOTIFY says when a place frees elsewhere in the fleet.
        So it is tried again soon: at its bucket's next token or 50 ms, doubling while its
        claims come back empty, up to the poll interval.
        """
        now = time.monotonic()
        for request in requests:
            limits = self._limits.get(request.name)
            if limits is None:
                continue
            if limits.tenant_ordered:
                tenants = [job.tenant for job in claimed if job.name == request.name]
                after = self._cursors.get(request.name, "")
                self._cursors[request.name] = flow.next_cursor(after, tenants)
            if got[request.name] >= request.limit:
                self._held_back.pop(request.name, None)
                continue
            streak = (
                self._held_back.get(request.name, (0.0, 0, 0.0))[1] + 1
                if not got[request.name]
                else 0
            )
            delay = min(
                self.config.poll_interval,
                flow.rate_retry_seconds(limits) * 2 ** min(streak, 16),
            )
            self._held_back[request.name] = (now + delay, streak, now)
            if streak % 8 == 3:
                # Empty tries in a row: a gate row gone (deleted by hand) would hold the type
                # back for good, and costs one insert to put back. After the pass's commit:
                # a failure here must not undo the pass (its claimed jobs are to dispatch).
                try:
                    flow.restore_gates({request.name: limits}, using=self.config.database)
                except Exception as exc:
                    logger.warning(
                        "could not check the gate row of %s (%s)",
                        request.name,
                        one_line(exc),
                        extra={"job_type": request.name, "action": "gate_check_failed"},
                    )

    def _dispatch(self, claimed: list[ClaimedJob], *, leased_at: float) -> None:
        if not claimed:
            return
        on_loop: list[Running] = []
        on_threads: list[Callable[[], None]] = []
        dispatched = []
        for job in claimed:
            job_type = self.registry[job.name]
            ctx = make_context(job, job_type, using=self.config.database)
            running = Running(job, job_type, ctx, leased_at=leased_at)
            dispatched.append(running)
            metrics.for_type(job.name).queue_latency.observe(job.latency)
            if job_type.is_async:
                on_loop.append(running)
            else:
                on_threads.append(partial(self._execute, running))
        with self._lock:
            for running in dispatched:
                self._held[running.job.id, running.job.claim_token] = running
                self._in_flight_by_name[running.job.name] += 1
            self._in_flight += len(dispatched)
            if self._recent_held:
                self._held_run = min(self._recent_held)
            held_run = self._held_run
        for name, count in Counter(job.name for job in claimed).items():
            metrics.for_type(name).claimed.inc(count)
        if on_threads:
            self._pool.submit_many(on_threads, wake=_threads_to_wake(len(on_threads), held_run))
        if on_loop:
            self._to_loop(on_loop)

    def _to_loop(self, batch: list[Running]) -> None:
        """Async jobs go to the event loop in one hand-off a batch, not one a job."""
        try:
            self._pool.event_loop.loop.call_soon_threadsafe(self._start_tasks, batch)
        except BaseException as exc:  # the loop is gone: a bug of ours, never a leaked slot
            logger.exception("could not hand %d async jobs to the event loop", len(batch))
            for running in batch:
                self._finished(running, self._worker_failure(running, exc))

    def _start_tasks(self, batch: list[Running]) -> None:
        """On the loop thread: one task per job a drain has not handed back meanwhile."""
        for running in batch:
            with self._lock:
                # A job resumed from _waiting holds its slot already.
                if running.handed_back or not (running.started or self._slot_taken(running)):
                    continue
            try:
                task = self._pool.event_loop.loop.create_task(
                    self._execute_on_loop(running), name=f"worker of job {running.job.job_id}"
                )
                task.add_done_callback(partial(self._never_started, running))
            except BaseException as exc:
                logger.exception("worker error starting job %s", running.job.job_id)
                self._finished(running, self._worker_failure(running, exc))

    def _slot_taken(self, running: Running) -> bool:
        """Count ``running``'s handler as started if a slot is free (under ``self._lock``).

        A prefetched job, held beyond the slots, can reach its start while every slot is
        taken: a thread-run one while async handlers hold slots the threads do not see, an
        async one while the slots are full. It then waits in ``_waiting`` until a handler
        ends (:meth:`_finished` resumes it), so handlers of both kinds never run more than
        ``concurrency`` at once.
        """
        if self.handlers_running >= self.config.concurrency:
            self._waiting.append(running)
            return False
        self._start(running)
        return True

    def _start(self, running: Running) -> None:
        """Count ``running``'s handler in (under ``self._lock``): a prefetched job is held, not
        running, until now, and its timeout runs from now, not from its claim."""
        running.started = True
        running.ctx.started = time.monotonic()
        self.handlers_running += 1

    def _next_waiting(self) -> Running | None:
        """The first job waiting for a slot, counted in if a slot is free (under
        ``self._lock``): the slot is its own before it reaches its thread or the loop, and a
        drain leaves it to run. Jobs a drain handed back meanwhile are dropped."""
        while self._waiting and self.handlers_running < self.config.concurrency:
            running = self._waiting.popleft()
            if not running.handed_back:
                self._start(running)
                return running
        return None

    def _resume(self, running: Running) -> None:
        """Start a job that waited for a slot, where its kind runs.

        An async job the loop cannot take (it is gone: a bug of ours) ends at once, and its
        end resumes the next waiting job: those are started here in turn, not by recursion.
        """
        resuming = self._resuming
        if getattr(resuming, "pending", None) is not None:
            resuming.pending.append(running)
            return
        resuming.pending = [running]
        try:
            while resuming.pending:
                job = resuming.pending.pop(0)
                if job.job_type.is_async:
                    self._to_loop([job])
                else:
                    self._pool.submit(partial(self._execute, job))
        finally:
            resuming.pending = None

    def _never_started(self, running: Running, task: asyncio.Task[None]) -> None:
        """A job's task cancelled before its first step (the loop's close cancels every task
        on it) never ran the ``finally`` that frees its slot: freed here instead."""
        if task.cancelled() and not running.finished:
            self._finished(running, self._worker_failure(running, asyncio.CancelledError()))

    async def _execute_on_loop(self, running: Running) -> None:
        """An async job's task. Whatever happens in it, the slot is freed."""
        outcome: Outcome | None = None
        began = time.monotonic()
        try:
            outcome = await execute_on_loop(
                running,
                self._pool,
                shutting_down=self._stopping.is_set,
                lease=self.config.lease_duration,
            )
        except BaseException as exc:  # a bug of ours, or the loop closing under the job
            if not running.lost:  # else abandoned at exit: the loop's close cancelled it
                logger.exception("worker error running job %s", running.job.job_id)
            outcome = self._worker_failure(running, exc)
        finally:
            self._finished(running, outcome, ran=time.monotonic() - began)

    @staticmethod
    def _worker_failure(running: Running, exc: BaseException) -> Outcome | None:
        if running.lost:
            return None
        return failure_outcome(
            running, ErrorCode.HANDLER_ERROR, f"the worker failed running the job: {exc!r}"
        )

    def _execute(self, running: Running) -> None:
        """Runs on a handler thread. Whatever happens in it, the slot is freed."""
        with self._lock:
            # Not when a drain released the job before this thread took it, nor while async
            # handlers hold the slots this thread would take (it then waits in _waiting); a
            # job resumed from _waiting holds its slot already.
            if running.handed_back or not (running.started or self._slot_taken(running)):
                return
        outcome: Outcome | None = None
        began = time.monotonic()
        # Whether to measure this job's CPU time (CPU_SAMPLE_INTERVAL): from the thread's CPU
        # clock as its previous task ended, if that was a job measured and nothing else ran
        # on the thread since (an async job's steps borrow pool threads); else read now. The
        # pool's own steps between two tasks count with the second (microseconds).
        pool: HandlerPool | None = getattr(self, "_pool", None)  # set by run()
        task = pool.tasks_started() if pool is not None else 0
        local = self._thread_cpu
        mark = getattr(local, "mark", None)  # (task, CPU clock, when read) at the last read
        cpu_began = None
        if (
            mark is None
            or local.last_ran >= CPU_SAMPLE_INTERVAL
            or began - mark[2] >= CPU_SAMPLE_INTERVAL
        ):
            cpu_began = mark[1] if task and mark and mark[0] == task - 1 else time.thread_time()
        try:
            outcome = execute(
                running, shutting_down=self._stopping.is_set, lease=self.config.lease_duration
            )
        except BaseException as exc:  # a bug of ours must not leak the slot
            logger.exception("worker error running job %s", running.job.job_id)
            outcome = self._worker_failure(running, exc)
        finally:
            ended = time.monotonic()
            ran = local.last_ran = ended - began
            held = None
            if cpu_began is not None:
                cpu_ended = time.thread_time()
                local.mark = (task, cpu_ended, ended)
                held = thread_held(ran, cpu_ended - cpu_began)
            self._finished(running, outcome, ran=ran, held=held)

    def _finished(
        self,
        running: Running,
        outcome: Outcome | None,
        *,
        ran: float | None = None,
        held: float | None = None,
    ) -> None:
        """Free the job's slot, start a job that waited for one, and queue the outcome;
        ``ran``: the handler's time, ``held``: how long a thread-run one counts as holding
        its thread (:func:`thread_held`; None: not measured, see CPU_SAMPLE_INTERVAL)."""
        if outcome is not None:  # the last progress report goes with the outcome
            outcome = with_last_report(running, outcome)
        with self._lock:
            if ran is not None:
                mean = self._mean_run
                self._mean_run = ran if mean is None else mean + _RUN_TIME_WEIGHT * (ran - mean)
            if held is not None:
                self._recent_held.append(held)
            running.finished = True
            if running.started:  # counted in at its handler's start
                self.handlers_running -= 1
            resumed = self._next_waiting() if self._waiting else None
            self._in_flight -= 1
            self._in_flight_by_name[running.job.name] -= 1
            self._acks.append((running, outcome))
            now = time.monotonic()
            # The loop is woken for the first outcome waiting (its wait is then at most
            # ack_interval) and when they are due, not for each: a wake-up costs the handler
            # threads a turn at the GIL.
            wake = self._first_ack_at is None or self._acks_due(now)
            if self._first_ack_at is None:
                self._first_ack_at = now
        if resumed is not None:
            self._resume(resumed)
        if wake:
            self._wake.set()

    def _settle(
        self,
        acks: list[tuple[Running, Outcome | None]],
        outcomes: list[tuple[Running, Outcome]],
        report: OutcomeReport | None,
    ) -> None:
        with self._lock:
            for running, _ in acks:
                self._held.pop((running.job.id, running.job.claim_token), None)
        if report is not None and report.settle and self._dependents is not None:
            self._dependents.wake()  # jobs wait for one this pass ended: release them now
        counted: Counter[tuple[str, str]] = Counter()  # one update a type and outcome
        for running, _ in acks:
            if running.completed:  # written by its handler's transaction (jobs.complete)
                completed = Outcome.succeeded(running.job)
                self._history.count_completed(running, completed)
                self._log_outcome(running, completed, counted)
        for running, outcome in outcomes:
            job = running.job
            # Nothing fenced: no token to look up.
            if report is not None and report.fenced and report.was_fenced(outcome):
                metrics.fenced_outcomes.labels(job.name).inc()
                logger.warning(
                    "outcome of job %s (%s) discarded: this worker no longer holds it",
                    job.job_id,
                    job.name,
                    extra={"job_id": job.job_id, "job_type": job.name, "action": "fenced"},
                )
                continue
            self._log_outcome(running, outcome, counted)
        for (name, kind), count in counted.items():
            metrics.for_type(name).outcome(kind).inc(count)

    def _log_outcome(
        self, running: Running, outcome: Outcome, counted: Counter[tuple[str, str]]
    ) -> None:
        """Log an outcome written, and add it to ``counted`` (by type and kind)."""
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
        kind = _OUTCOME_KINDS.get(outcome.state, "retried")
        counted[job.name, kind] += 1
        if kind == "retried" and outcome.at is None:
            # Written in the same statement as the next claim, which could not see it, and
            # announced by no NOTIFY: look again when it is due, not only at the next poll.
            self._next_poll = min(self._next_poll, time.monotonic() + outcome.delay)
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
        if kind == "cancelled":  # as an operator asked: nothing went wrong
            logger.info("job %s (%s) cancelled", job.job_id, job.name, extra=extra)
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
            if self._capacity() > self._in_flight:
                # A held-back type whose wait ran out during the pass is due now.
                waits.extend(max(0.0, at - now) for at, _, _ in self._held_back.values())
            if self._deferred:
                waits.append(self._deferred_at - now)
            if self._first_ack_at is not None:
                waits.append(self._first_ack_at + self.config.ack_interval - now)
        return max(0.0, min(waits))

    def _work_arrived(self, name: str | None = None) -> None:
        """NOTIFY listener callback (another thread)."""
        with self._lock:
            self._noticed.add(name)
        if name is None:
            self._exhausted.clear()
        else:
            self._exhausted.discard(name)
        # New work for a type held back is tried soon, since the type may have been held back
        # for want of due jobs; but new work is no room under a limit, so however many
        # notices come, the type is tried at most every NOTICE_RETRY.
        with self._lock:  # the run loop reads the waits under it
            for held in [name] if name is not None else list(self._held_back):
                if held in self._held_back:
                    at, streak, tried = self._held_back[held]
                    self._held_back[held] = (min(at, tried + NOTICE_RETRY), streak, tried)
        self._wake.set()

    # -- maintenance -------------------------------------------------------------------------

    def _recover(self) -> None:
        if self._maintenance.recover():
            self._exhausted.clear()  # requeued jobs are due now: claim them at once

    def _maintain(self) -> None:
        for row in self._maintenance.run_once():
            self._terminal(row.name, row.job_id, row.code, "failed by the exhaustion pass")

    # -- drain -------------------------------------------------------------------------------

    # -- process plumbing --------------------------------------------------------------------

    @property
    def _connection(self) -> BaseDatabaseWrapper:
        """The calling thread's connection to the worker's database (the run loop's own)."""
        return connections[self.config.database]

    @property
    def _lease_seconds(self) -> float:
        return self.config.lease_duration.total_seconds()

    def _capacity(self) -> int:
        """How many jobs the worker may hold now (called under ``self._lock``): one a handler
        thread, plus what the threads finish within :data:`PREFETCH_HORIZON`, up to the
        prefetch limit, once its handlers have been measured."""
        limit = self.config.prefetch
        if not limit or self._mean_run is None:
            return self.config.concurrency
        finishing = self.config.concurrency * PREFETCH_HORIZON / max(self._mean_run, 1e-6)
        return self.config.concurrency + min(limit, int(finishing))

    def _held_snapshot(self) -> list[Running]:
        # A job its handler's transaction completed is no longer held, though the handler
        # may still run: renewing it would report its lease lost.
        with self._lock:
            return [r for r in self._held.values() if not completed_by_handler(r.ctx)]

    def _log_start(self) -> None:
        # A type's own limit below the slot count is said, so a slow drain is not a mystery.
        types = []
        for name in self._names:
            limit = self.registry[name].policy.concurrency
            capped = limit is not None and limit < self.config.concurrency
            types.append(f"{name} (at most {limit} at once)" if capped else name)
        logger.info(
            "worker %s started: database %s, %d slots, scope %s, types %s",
            self.config.identity,
            self.config.database,
            self.config.concurrency,
            self.config.scope,
            ", ".join(types) or "(none)",
            extra={"action": "started"},
        )
