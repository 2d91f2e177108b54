"""Slot accounting: the jobs the worker holds, the handlers running, the jobs waiting for a slot.

A job is *held* from its claim until its outcome is settled, and *in flight* until its
handler ends (or a drain hands it back). The worker claims up to its capacity: a slot a
handler, plus what ``--prefetch`` lets it hold beyond them (:mod:`jobs.worker.handoff`). A
held job *starts* (its handler counted in :attr:`Slots.running`) only where a slot is free;
one that reaches its start with every slot taken waits in :attr:`Slots.waiting` until a
handler ends, so handlers of both kinds never run more than ``concurrency`` at once::

    claimed ──hold──▶ held, in flight ──take──▶ running ──end──▶ held (outcome queued)
                           │    └──(no slot)──▶ waiting ──(a handler ends)──┘
                           └──drain: handed back, no longer held
    held ──settled (its outcome written)──▶ gone

One lock guards it all, and the completer's queued outcomes too (:mod:`jobs.worker.completer`):
a handler's end frees its slot and queues its outcome in one step, so whoever finds no job in
flight finds every outcome queued. Methods marked "under the lock" expect the caller to hold
:attr:`Slots.lock`; the others take it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from uuid import UUID

from jobs.api.effects import completed_by_handler
from jobs.worker.execution import Running
from jobs.worker.handoff import RunTimes


class Slots:
    """The worker's slots and held jobs (see the module docstring)."""

    def __init__(self, concurrency: int, *, prefetch: int = 0) -> None:
        self.lock = threading.Lock()
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.times = RunTimes()
        # Keyed by (id, claim token): after a stall the worker may hold a stale attempt and a
        # fresh claim of the same job at once, and each must be settled on its own.
        self.held: dict[tuple[int, UUID], Running] = {}
        self.in_flight = 0
        self.by_name: Counter[str] = Counter()
        # Handlers started and not finished (jobs_worker_running reads it when scraped).
        self.running = 0
        self.waiting: deque[Running] = deque()

    # -- what the loop plans with ----------------------------------------------------------

    def capacity(self) -> int:
        """How many jobs the worker may hold now (under the lock)."""
        return self.times.capacity(self.concurrency, self.prefetch)

    def free(self) -> int:
        """Jobs the next claim may take."""
        with self.lock:
            return self.capacity() - self.in_flight

    def room(self) -> tuple[int, int, dict[str, int]]:
        """Jobs the next claim may take, slots idle (async jobs start at once), and the jobs
        in flight by type."""
        with self.lock:
            free = self.capacity() - self.in_flight
            idle = self.concurrency - self.in_flight
            return free, idle, dict(self.by_name)

    @property
    def busy(self) -> int:
        """Jobs in flight."""
        with self.lock:
            return self.in_flight

    def snapshot(self) -> list[Running]:
        """The held jobs whose leases the keeper renews.

        A job its handler's transaction completed is no longer held, though the handler may
        still run: renewing it would report its lease lost.
        """
        with self.lock:
            return [r for r in self.held.values() if not completed_by_handler(r.ctx)]

    def empty(self) -> bool:
        """No job held."""
        with self.lock:
            return not self.held

    # -- a job's way through ---------------------------------------------------------------

    def hold(self, batch: list[Running]) -> float | None:
        """Hold claimed jobs, in flight; returns the recent handlers' shortest thread time,
        which this pass's hand-off goes by."""
        with self.lock:
            for running in batch:
                self.held[running.job.id, running.job.claim_token] = running
                self.by_name[running.job.name] += 1
            self.in_flight += len(batch)
            return self.times.read()

    def take(self, running: Running) -> bool:
        """Count ``running``'s handler as started if a slot is free (under the lock).

        A prefetched job, held beyond the slots, can reach its start while every slot is
        taken: a thread-run one while async handlers hold slots the threads do not see, an
        async one while the slots are full. It then waits in :attr:`waiting` until a handler
        ends (:meth:`end` resumes it).
        """
        if self.running >= self.concurrency:
            self.waiting.append(running)
            return False
        self._start(running)
        return True

    def end(self, running: Running) -> Running | None:
        """``running``'s handler ended (under the lock): its slot is free, and the first job
        waiting for one, counted in, is returned for its kind's runner to start."""
        running.finished = True
        if running.started:  # counted in at its handler's start
            self.running -= 1
        resumed = self._next_waiting() if self.waiting else None
        self.in_flight -= 1
        self.by_name[running.job.name] -= 1
        return resumed

    def settled(self, done: Iterable[Running]) -> None:
        """Jobs whose outcomes were written (or given up): no longer held."""
        with self.lock:
            for running in done:
                self.held.pop((running.job.id, running.job.claim_token), None)

    def _start(self, running: Running) -> None:
        """Count ``running``'s handler in (under the lock): a prefetched job is held, not
        running, until now, and its timeout runs from now, not from its claim."""
        running.started = True
        running.ctx.started = time.monotonic()
        self.running += 1

    def _next_waiting(self) -> Running | None:
        """The first job waiting for a slot, counted in if a slot is free (under the lock):
        the slot is its own before it reaches its thread or the loop, and a drain leaves it
        to run. Jobs a drain handed back meanwhile are dropped."""
        while self.waiting and self.running < self.concurrency:
            running = self.waiting.popleft()
            if not running.handed_back:
                self._start(running)
                return running
        return None

    # -- the drain -------------------------------------------------------------------------

    def take_unstarted(self) -> list[Running]:
        """Held jobs no handler has taken, no longer held: a thread that takes one later
        finds it handed back and leaves it."""
        with self.lock:
            return self._unhold_unstarted()

    def cancel_started(self) -> list[Running]:
        """Ask the running handlers to stop; returns the jobs no handler has taken, no longer
        held (:meth:`take_unstarted`)."""
        with self.lock:
            for running in self.held.values():
                if running.started and not (running.finished or running.lost):
                    running.shutdown = True
                    running.ctx.cancelled.set()
            return self._unhold_unstarted()

    def abandon(self) -> list[Running]:
        """Jobs whose handlers still run at exit, marked lost: they keep their leases, and no
        outcome of theirs is written."""
        with self.lock:
            stuck = [r for r in self.held.values() if not r.finished and not r.lost]
            for running in stuck:
                running.lost = True
            return stuck

    def _unhold_unstarted(self) -> list[Running]:
        unstarted = [
            r
            for r in self.held.values()
            if not (r.finished or r.lost or r.started or r.handed_back)
        ]
        for running in unstarted:
            running.handed_back = True
            self.held.pop((running.job.id, running.job.claim_token), None)
            self.in_flight -= 1
            self.by_name[running.job.name] -= 1
        return unstarted
