"""The outcome completer: handlers' outcomes, batched into the run loop's passes, and settled.

A handler's end queues its outcome (:meth:`Completer.add`, in the step that frees its slot).
The loop takes the queued outcomes when they are due (:meth:`Completer.take`) and writes them
in its pass, together with its next claim (:func:`jobs.queue.record_and_claim`); the completer
then settles them by the pass's report (:mod:`jobs.worker.settle`)::

    ended ──add──▶ queued ──take, when due──▶ the pass ──▶ written, fenced: settled
                     ▲                          │
                     └──after BUSY_RETRY…───────┴─ busy (another session holds the row):
                                                   deferred; after CONTENDED_AFTER tries
                                                   written alone, with a short lock wait

Outcomes are due when the worker stops or is idle, when half its slots are free (for fewer
than :data:`SMALL_PASS`, unless the rest will be done soon), or once the first has waited
``ack_interval``: a pass costs PostgreSQL about the same whatever its size.

When the pass statement fails, every outcome is written again alone, in its own transaction
with a short lock wait (:data:`LOCK_WAIT`, :func:`write_one_by_one`). What happens to one that
still fails depends on why:

* a **data error** (SQLSTATE class 22, 23 or 54: a value a user's trigger or a constraint
  rejects, or a limit it passes; or an exception a user's trigger raises, P0001) is the
  database refusing this outcome: it becomes a ``failed`` / ``handler_error`` outcome whose
  detail carries the database's message (and if even that is refused, the job is given up
  to its lease);
* anything else, a lock or statement timeout, a deadlock, a serialization failure, is
  **contention**, never a verdict on the job: the outcome is deferred (``busy``), its lease
  kept renewed, and written alone, away from the pass statement, until the lock is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from uuid import UUID

from django.db import Error as DjangoDbError

from jobs import queue
from jobs.db.sqlstate import one_line, refused_data, transient, unreachable
from jobs.queue import Outcome, OutcomeReport
from jobs.runs import ErrorCode
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, run_rows
from jobs.worker.settle import Settler
from jobs.worker.slots import Slots

logger = logging.getLogger("jobs.worker")

#: A finished handler and its outcome (None: nothing to write, the job was given up).
Ack = tuple[Running, Outcome | None]

#: Outcomes of fewer slots than this, half the worker's, wait for the other half when those
#: should be done within ack_interval: a pass costs PostgreSQL about 0.4 ms whatever its size,
#: and with 10 slots of short handlers, passes of 5 halved the drain.
SMALL_PASS = 16

#: An outcome whose row another session holds locked waits and is retried; this many tries
#: in a row, and the worker warns (one try is usually its own lease renewal, a moment's lock).
BUSY_WARN_AFTER = 3
#: After this many busy tries in a row, such an outcome is written alone, with a short wait
#: for the lock (:data:`LOCK_WAIT`): a pass statement skips locked rows and never waits, and
#: a batch whose row siblings' passes keep taking would otherwise keep finding it held.
CONTENDED_AFTER = 2
#: The first retry of such an outcome comes this long after (seconds), each next one twice as
#: long after, up to the poll interval. The lock is mostly held for a moment: by the worker's
#: own lease renewal, or by another worker's claim, which locks a row it read as queued and
#: found claimed meanwhile until its statement ends. Waiting a poll interval each time held
#: the last jobs of a two-worker drain running for half a second.
BUSY_RETRY = 0.005

#: How long one outcome written alone waits for a lock (seconds) before it is deferred. Short:
#: the lock that made the pass statement fail may still be held, and the other outcomes and
#: the next claim must not wait for it.
LOCK_WAIT = 0.05
#: Times one outcome is written again after a deadlock or serialization failure before it is
#: put off to the next pass.
TRANSIENT_RETRIES = 3


def to_write(acks: list[Ack]) -> list[tuple[Running, Outcome]]:
    """The outcomes of ``acks`` to send (none for jobs given up)."""
    return [(r, o) for r, o in acks if o is not None and not r.lost]


class Completer:
    """Queued outcomes, their deferral and their settling (see the module docstring).

    The queued and deferred outcomes are guarded by the slots' lock (:mod:`jobs.worker.slots`).
    """

    def __init__(
        self, config: WorkerConfig, slots: Slots, settler: Settler, stopping: threading.Event
    ) -> None:
        self.config = config
        self.settler = settler
        self._slots = slots
        self._stopping = stopping
        self.acks: list[Ack] = []
        # Outcomes whose row was locked by another session, retried from deferred_at on.
        self.deferred: list[Ack] = []
        self.deferred_at = 0.0
        self.first_at: float | None = None  # when the oldest queued outcome was queued

    # -- queued by the handlers ------------------------------------------------------------

    def add(self, running: Running, outcome: Outcome | None) -> bool:
        """Queue a finished handler's outcome (under the slots' lock); True when the loop is
        to be woken: for the first outcome waiting (its wait is then at most ack_interval) and
        when they are due, not for each, as a wake-up costs the handler threads a turn at the
        GIL."""
        self.acks.append((running, outcome))
        now = time.monotonic()
        wake = self.first_at is None or self._due(now)
        if self.first_at is None:
            self.first_at = now
        return wake

    # -- taken by the loop -----------------------------------------------------------------

    def take(self, now: float) -> tuple[list[Ack], bool]:
        """The outcomes to write now, if they are due, and whether others wait to be."""
        with self._slots.lock:
            if self.deferred and now >= self.deferred_at:
                self.acks.extend(self.deferred)
                self.deferred = []
                self.first_at = self.first_at or now
            if not self.acks:
                return [], False
            if not self._due(now):
                return [], True
            acks, self.acks, self.first_at = self.acks, [], None
            return acks, False

    def put_back(self, acks: list[Ack]) -> None:
        """Outcomes a failed pass did not write, first in line for the next."""
        with self._slots.lock:
            self.acks[:0] = acks
            self.first_at = self.first_at or time.monotonic()

    def _due(self, now: float) -> bool:
        """Whether the outcomes waiting are to be written now (under the slots' lock)."""
        slots = self._slots
        capacity = slots.capacity()
        free = capacity - slots.in_flight
        if self._stopping.is_set() or slots.in_flight == 0:
            return True
        if now - (self.first_at or now) >= self.config.ack_interval:
            return True
        if free < max(1, capacity // 2):
            return False
        # Half the slots are free. A pass for a few of them costs about as much as one for
        # all: when the rest should be done in a moment, wait for them (ack_interval at most).
        return free >= SMALL_PASS or not slots.times.finishing_soon(
            slots.in_flight, self.config.ack_interval
        )

    def waits(self, now: float) -> list[float]:
        """How long until deferred outcomes are due again, and queued ones at the latest."""
        with self._slots.lock:
            waits = [self.deferred_at - now] if self.deferred else []
            if self.first_at is not None:
                waits.append(self.first_at + self.config.ack_interval - now)
            return waits

    @property
    def pending(self) -> bool:
        """Outcomes queued or deferred, not written yet."""
        with self._slots.lock:
            return bool(self.acks or self.deferred)

    # -- written -----------------------------------------------------------------------------

    def counted(self, outcomes: list[tuple[Running, Outcome]], report: OutcomeReport) -> None:
        """The pass wrote ``outcomes`` without counting them: the worker's tally does."""
        self.settler.history.count(outcomes, report)

    def written(
        self,
        acks: list[Ack],
        outcomes: list[tuple[Running, Outcome]],
        report: OutcomeReport | None,
    ) -> None:
        """The pass sent ``outcomes`` (of ``acks``): busy ones are deferred, the rest settled."""
        if report is not None and report.busy:
            acks, outcomes = self.defer_busy(acks, outcomes, report.busy_tokens)
        self._slots.settled(r for r, _ in acks)
        self.settler.settle(acks, outcomes, report)

    def defer_busy(
        self,
        acks: list[Ack],
        outcomes: list[tuple[Running, Outcome]],
        busy: frozenset[UUID],
    ) -> tuple[list[Ack], list[tuple[Running, Outcome]]]:
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
        with self._slots.lock:
            self.deferred.extend(waiting)
            self.deferred_at = time.monotonic() + delay
        keep = [(r, o) for r, o in acks if o is None or o.token not in busy]
        return keep, [(r, o) for r, o in outcomes if o.token not in busy]

    def write_contended(self, acks: list[Ack]) -> list[Ack]:
        """Write the outcomes that met contention before, each alone with a short lock wait,
        so a lock still held defers them again without holding up the pass statement.

        Returns the other acks, for the pass. Raises when the database cannot be reached
        (nothing settled: the caller puts ``acks`` back).
        """
        mine = [(r, o) for r, o in acks if r.contended]
        rest = [(r, o) for r, o in acks if not r.contended]
        report, outcomes = write_one_by_one(to_write(mine))
        self.written(mine, outcomes, report)
        return rest

    def write_alone(
        self, outcomes: list[tuple[Running, Outcome]], refusal: Exception
    ) -> tuple[OutcomeReport, list[tuple[Running, Outcome]]]:
        """The pass statement was refused: one outcome the database refused must not hold back
        the others, so each is written alone (:func:`write_one_by_one`)."""
        logger.warning(
            "the database refused a batch of %d outcomes (%s); writing them one by one",
            len(outcomes),
            one_line(refusal),
            extra={"action": "outcome_fallback"},
        )
        return write_one_by_one(outcomes)

    def flush_history(self, now: float | None = None, *, final: bool = False) -> None:
        self.settler.flush_history(now, final=final)

    def abandon(self) -> list[Ack]:
        """The deferred outcomes, given up at exit (their jobs run again after their leases)."""
        with self._slots.lock:
            unwritten, self.deferred = self.deferred, []
            return unwritten


# -- outcomes written one by one ------------------------------------------------------------


def write_one_by_one(
    outcomes: list[tuple[Running, Outcome]],
) -> tuple[OutcomeReport, list[tuple[Running, Outcome]]]:
    """Each outcome in its own transaction; one the database refuses becomes a failure, one
    that meets contention is reported busy (and marked ``contended``).

    Returns the report and the outcomes as written (a refused one replaced).
    """
    results: dict[str, list[int]] = {"applied": [], "fenced": [], "busy": []}
    tokens: dict[str, set[UUID]] = {"applied": set(), "fenced": set(), "busy": set()}
    written: list[tuple[Running, Outcome]] = []
    for running, outcome in outcomes:
        result, outcome = _write_or_fail(running, outcome)
        if result is None:
            continue
        results[result].append(running.job.id)
        tokens[result].add(outcome.token)
        written.append((running, outcome))
    report = OutcomeReport(
        applied=tuple(results["applied"]),
        fenced=tuple(results["fenced"]),
        busy=tuple(results["busy"]),
        applied_tokens=frozenset(tokens["applied"]),
        busy_tokens=frozenset(tokens["busy"]),
    )
    return report, written


def _write_or_fail(running: Running, outcome: Outcome) -> tuple[str | None, Outcome]:
    """Write ``outcome``; if the database refuses its data, write a failure instead.

    Returns what happened (None: not even the failure could be stored, and the job is given
    up to its lease) and the outcome it happened to. Raises when the database is unreachable.
    """
    job = running.job
    try:
        return _write_one_retrying(running, outcome), outcome
    except Exception as exc:  # refused by the database, or a bug in a run-row update
        if unreachable(exc):
            raise
        if isinstance(exc, DjangoDbError) and not refused_data(exc):
            return _contended(running, exc), outcome
        refusal = one_line(exc)
    logger.error(
        "the database refused the outcome of job %s (%s): %s; failing the job",
        job.job_id,
        job.name,
        refusal,
        extra={"job_id": job.job_id, "job_type": job.name, "action": "refused"},
    )
    failure = Outcome.failed(
        job,
        code=ErrorCode.HANDLER_ERROR,
        detail=f"the database refused this attempt's outcome ({outcome.state}): {refusal}",
    )
    try:
        return _write_one_retrying(running, failure), failure
    except Exception as again:
        if unreachable(again):
            raise
        if isinstance(again, DjangoDbError) and not refused_data(again):
            return _contended(running, again), failure
        # Not even the failure could be stored: let the lease expire.
        logger.error("could not fail job %s either: %s", job.job_id, again)
        running.lost = True
        return None, failure


def _contended(running: Running, exc: BaseException) -> str:
    """An outcome that met contention (a lock or statement timeout): deferred, and from now
    on written alone (:func:`write_one_by_one`), not in the pass statement it held up."""
    first = not running.contended
    running.contended = True
    logger.log(
        logging.WARNING if first else logging.DEBUG,
        "the outcome of job %s (%s) met %s; deferred, its lease kept",
        running.job.job_id,
        running.job.name,
        one_line(exc),
        extra={"job_id": running.job.job_id, "action": "outcome_deferred"},
    )
    return "busy"


def _write_one_retrying(running: Running, outcome: Outcome) -> str:
    """:func:`_write_one`, again after a transient refusal; ``busy`` if it keeps coming.

    A deadlock (two outcome statements that took batch or dependent rows in opposite orders:
    PostgreSQL aborts one) says nothing about the outcome: it must never become a failure.
    """
    for attempt in range(1, TRANSIENT_RETRIES + 1):
        try:
            return _write_one(running, outcome)
        except DjangoDbError as exc:
            if not transient(exc):
                raise
            if attempt == TRANSIENT_RETRIES:
                logger.warning(
                    "the outcome of job %s (%s) met %s %d times; trying in the next pass",
                    running.job.job_id,
                    running.job.name,
                    one_line(exc),
                    attempt,
                    extra={"job_id": running.job.job_id, "action": "outcome_deferred"},
                )
    return "busy"  # put off: the pass defers busy outcomes to the next one


def _write_one(running: Running, outcome: Outcome) -> str:
    """``applied``, ``fenced`` or ``busy`` (the row is locked by another session)."""
    report = queue.record(
        [outcome], lock_wait=LOCK_WAIT, runs=run_rows([running]), using=running.ctx.using
    )
    return "applied" if report.applied else "busy" if report.busy else "fenced"
