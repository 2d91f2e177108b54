"""How the worker hands jobs to its handler threads: the run times it goes by, and their bounds.

Three decisions rest on how long recent handlers took, and each is made a pass at a time:

- how many sleeping threads a pass's thread-run jobs wake (:func:`threads_to_wake`), by the
  shortest of the recent handlers' thread times (:attr:`RunTimes.shortest`);
- how many jobs the worker holds beyond its threads with ``--prefetch``
  (:meth:`RunTimes.capacity`), by their mean run time;
- whether the outcomes waiting are written now or wait for the handlers still running
  (:meth:`RunTimes.finishing_soon`, asked by :mod:`jobs.worker.completer`).

A handler thread reads its CPU clock for a job only now and then (:class:`CpuSampler`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

#: Prefetched jobs wait for a handler thread about this long at most: beyond its threads the
#: worker holds only as many jobs as they finish in this time, by the mean run time of its
#: recent thread-run handlers (seconds). Long handlers get no prefetch, so a worker busy with
#: them does not sit on jobs another worker could start.
PREFETCH_HORIZON = 0.02
# Weight of the latest run time in that mean.
_RUN_TIME_WEIGHT = 0.2

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


def threads_to_wake(jobs: int, run_time: float | None) -> int:
    """How many sleeping handler threads to wake for ``jobs`` thread-run jobs: before any
    has run, one, and the pool's stall watch wakes more while jobs wait (a first batch of
    short jobs on a thread each would wait for each other's turns at the interpreter's lock,
    and count those waits as their run time)."""
    if run_time is None:
        return 1
    return max(1, min(jobs, math.ceil(jobs * run_time / HANDOFF_HORIZON)))


class RunTimes:
    """Recent handlers' run times. Changed and read under the slots' lock
    (:class:`jobs.worker.slots.Slots`), which holds this object."""

    def __init__(self) -> None:
        self.mean: float | None = None  # seconds, of the handlers' runs; None: none yet
        # How long recent handlers held their thread (thread_held), and the shortest of
        # them, read once a pass (the hand-off and the wait for a pass's stragglers).
        self.recent: deque[float] = deque(maxlen=RECENT_RUNS)
        self.shortest: float | None = None

    def add(self, ran: float | None, held: float | None) -> None:
        """A handler ran ``ran`` seconds and held its thread ``held`` (None: not measured)."""
        if ran is not None:
            mean = self.mean
            self.mean = ran if mean is None else mean + _RUN_TIME_WEIGHT * (ran - mean)
        if held is not None:
            self.recent.append(held)

    def read(self) -> float | None:
        """The shortest recent thread time, fixed for the pass that dispatches now."""
        if self.recent:
            self.shortest = min(self.recent)
        return self.shortest

    def capacity(self, concurrency: int, prefetch: int) -> int:
        """How many jobs a worker of ``concurrency`` slots may hold: one a handler thread,
        plus what the threads finish within :data:`PREFETCH_HORIZON`, up to ``prefetch``,
        once its handlers have been measured."""
        if not prefetch or self.mean is None:
            return concurrency
        finishing = concurrency * PREFETCH_HORIZON / max(self.mean, 1e-6)
        return concurrency + min(prefetch, int(finishing))

    def finishing_soon(self, in_flight: int, within: float) -> bool:
        """Whether ``in_flight`` handlers should all be done ``within`` seconds, by how long
        recent handlers held their thread."""
        held = self.shortest
        return held is not None and in_flight * held < within


class CpuSampler:
    """Each handler thread's CPU clock, read for a job only now and then
    (:data:`CPU_SAMPLE_INTERVAL`)."""

    def __init__(self) -> None:
        # Per thread: (task, CPU clock, when read) at the last read, and its last job's time.
        self._local = threading.local()

    def begin(self, task: int, began: float) -> float | None:
        """The thread's CPU clock as the job that began at ``began`` starts, if this job is to
        be measured; else None.

        From the clock as the thread's previous task ended, if that was a job measured and
        nothing else ran on the thread since (an async job's steps borrow pool threads; the
        pool counts its ``task``); else read now. The pool's own steps between two tasks
        count with the second (microseconds).
        """
        local = self._local
        mark = getattr(local, "mark", None)
        if (
            mark is None
            or local.last_ran >= CPU_SAMPLE_INTERVAL
            or began - mark[2] >= CPU_SAMPLE_INTERVAL
        ):
            return mark[1] if task and mark and mark[0] == task - 1 else time.thread_time()
        return None

    def end(
        self, task: int, cpu_began: float | None, began: float, ended: float
    ) -> tuple[float, float | None]:
        """The job's run time, and how long it held its thread (None: not measured)."""
        local = self._local
        ran = local.last_ran = ended - began
        if cpu_began is None:
            return ran, None
        cpu_ended = time.thread_time()
        local.mark = (task, cpu_ended, ended)
        return ran, thread_held(ran, cpu_ended - cpu_began)
