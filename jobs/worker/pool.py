"""A fixed pool of handler threads, each with its own database connection.

Django connections are per thread. A handler thread keeps its connection between jobs for up
to ``JOBS["HANDLER_CONN_MAX_AGE"]`` (a worker is one long "request", and a new connection per
job would cost more than most jobs), but closes it after a job that left it broken or inside
a transaction, and closes every connection when the thread exits. A maximum age of 0 closes
after every job, like Django's request cycle with ``CONN_MAX_AGE = 0``.

Handing a job to a thread costs a thread wake-up (a futex call, a context switch and a turn
at the GIL), which for short jobs costs more than running them: a pass of 50 no-op jobs handed
out one a thread spent about half the worker's CPU on wake-ups. So tasks wait in one queue and
only as many threads are woken as the caller asks for; they take the waiting tasks in turn.
Tasks that nobody takes for a moment, because the threads woken are held by long ones, get
more threads from a stall watch (:meth:`HandlerPool._watch_stalls`), so a task does not wait
behind a long one while threads sleep.

The pool also owns the worker's one event loop for ``async def`` handlers
(:mod:`jobs.worker.event_loop`): started with the threads, each thread bound to it, closed
after the threads exit, so a drain ends with no task left on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from django.db import connections

from jobs.core.conf import jobs_settings
from jobs.worker import thread_connections
from jobs.worker.event_loop import HandlerLoop

logger = logging.getLogger("jobs.worker")

#: At shutdown, tasks left on the event loop get at least this long to end once cancelled.
LOOP_CLOSE_GRACE = 0.5

#: Tasks that no thread has taken for this long get another thread, if one sleeps (seconds).
STALL_AFTER = 0.01
#: ... or for this long, when the process was busy running Python meanwhile (at least
#: BUSY_SHARE of a CPU): the tasks then wait for a turn, not for I/O.
BUSY_STALL_AFTER = 0.1
BUSY_SHARE = 0.5
#: The stall watch keeps looking every STALL_AFTER for this long after it was last woken or
#: found tasks waiting, before it sleeps until a batch wakes it (seconds). A drain of short
#: jobs submits a batch every millisecond or two that its threads take at once: a watch that
#: slept whenever it found none was woken for each, a system call for the run loop and a
#: turn at the GIL for the watch (about 4 % of such a worker's Python time).
WATCH_LINGER = 0.1


class HandlerPool:
    """``size`` threads taking tasks in order. A thread that dies is replaced at once."""

    def __init__(self, size: int, name: str = "jobs-handler") -> None:
        # None tells a thread to exit (one per thread, from shutdown()).
        self._tasks: deque[Callable[[], None] | None] = deque()
        self._max_age = jobs_settings.HANDLER_CONN_MAX_AGE.total_seconds()
        self._name = name
        self._lock = threading.Lock()
        # Guards the task queue and the counts below; threads sleep on _ready, the stall
        # watch on _stalls (one lock for both).
        queue_lock = threading.Lock()
        self._ready = threading.Condition(queue_lock)
        self._stalls = threading.Condition(queue_lock)
        self._sleeping = 0  # threads waiting on _ready, woken or not
        self._waking = 0  # of those, threads notified and not yet back for a task
        self._taken_at = 0.0  # when a thread last took a task (monotonic)
        self._watch_idle = False  # the stall watch waits for tasks to arrive
        self._closing = False
        self._stopping = False
        self._started = 0
        self._busy = 0  # threads running a task now
        self._local = threading.local()  # per pool thread: tasks started (tasks_started)
        self._threads: list[threading.Thread] = []
        self.event_loop = HandlerLoop(f"{name}-loop")
        self.event_loop.start()
        for _ in range(size):
            self._start_thread()
        self._watch = threading.Thread(
            target=self._watch_stalls, name=f"{name}-stall-watch", daemon=True
        )
        self._watch.start()

    def _start_thread(self) -> None:
        with self._lock:
            thread = threading.Thread(
                target=self._loop, name=f"{self._name}-{self._started}", daemon=True
            )
            self._started += 1
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self.submit_many((task,))

    def submit_many(self, tasks: Iterable[Callable[[], None]], *, wake: int | None = None) -> None:
        """Queue ``tasks`` in order and wake ``wake`` sleeping threads for them (default: one
        a task). Fewer suits short tasks: the woken threads take the rest one after another,
        and the stall watch wakes more if tasks wait untaken."""
        with self._ready:
            before = len(self._tasks)
            self._tasks.extend(tasks)
            added = len(self._tasks) - before
            if not before:
                self._taken_at = time.monotonic()  # the stall clock starts with the batch
            self._wake_locked(added if wake is None else max(1, min(wake, added)))
            if self._watch_idle:
                self._stalls.notify()

    def _wake_locked(self, count: int) -> None:
        """Wake up to ``count`` threads that sleep and were not woken yet (under _ready)."""
        count = min(count, self._sleeping - self._waking)
        if count > 0:
            self._waking += count
            self._ready.notify(count)

    def _take(self) -> Callable[[], None] | None:
        """The next task, sleeping until there is one (None: exit)."""
        with self._ready:
            while not self._tasks:
                self._sleeping += 1
                try:
                    self._ready.wait()
                finally:
                    self._sleeping -= 1
                    self._waking = max(0, self._waking - 1)
            self._taken_at = time.monotonic()
            return self._tasks.popleft()

    def _watch_stalls(self) -> None:
        """Wake sleeping threads for tasks that nobody has taken for :data:`STALL_AFTER`.

        The threads woken for a batch take its tasks in turn; when all of them are held by
        long tasks (a handler waiting on I/O), the rest would wait for one to end. While tasks
        wait and threads sleep, this looks every :data:`STALL_AFTER` and, each time no task
        was taken since, wakes more: one, then twice as many at each stall in a row, so a
        batch of tasks that wait on I/O has every thread it needs within a few intervals. But
        only while the process is mostly idle: when it was busy running Python meanwhile (the
        CPU shared with other processes, or the interpreter's lock with its other threads),
        the tasks wait for a turn, not for I/O, and more threads would only wait with them;
        then one more thread at most every :data:`BUSY_STALL_AFTER`. Once no task has waited
        for :data:`WATCH_LINGER`, it sleeps until a batch wakes it.
        """
        ramp = 1
        checked_at, cpu_at = time.monotonic(), time.process_time()
        looking_until = checked_at + WATCH_LINGER
        with self._ready:
            while not self._closing:
                if not self._tasks or self._sleeping == self._waking:
                    # No task, or no thread left to wake: only a new batch changes that (a
                    # thread that finishes takes a waiting task rather than sleep).
                    ramp = 1
                    now = time.monotonic()
                    if now < looking_until:
                        # A batch soon is not worth a wake-up. The process's CPU share is
                        # measured over this wait: over the moment after it, only the watch
                        # runs, and the process would count as busy.
                        checked_at, cpu_at = now, time.process_time()
                        self._stalls.wait(STALL_AFTER)
                    else:
                        self._watch_idle = True
                        self._stalls.wait()
                        self._watch_idle = False
                        looking_until = time.monotonic() + WATCH_LINGER
                        checked_at, cpu_at = time.monotonic(), time.process_time()
                    continue
                now, cpu = time.monotonic(), time.process_time()
                looking_until = now + WATCH_LINGER
                busy = (cpu - cpu_at) / max(now - checked_at, 1e-6) >= BUSY_SHARE
                stalled = now - self._taken_at
                if not self._waking and stalled >= (BUSY_STALL_AFTER if busy else STALL_AFTER):
                    self._wake_locked(1 if busy else ramp)
                    ramp = 1 if busy else ramp * 2  # each idle stall in a row: twice as many
                    self._taken_at = now  # the woken threads' time to get here
                # Next look when the tasks will have waited STALL_AFTER (found by a look while
                # lingering, they may have waited part of it already). The CPU share is
                # measured anew from a full wait only: over a short one it says little.
                waited = now - self._taken_at
                if waited >= STALL_AFTER:
                    checked_at, cpu_at = now, cpu
                    self._stalls.wait(STALL_AFTER)
                else:
                    self._stalls.wait(STALL_AFTER - waited)

    def shutdown(self, timeout: float) -> bool:
        """Ask threads to exit after their current task, then close the event loop.

        True if every thread exited within ``timeout`` and the loop closed. Tasks left on
        the loop are cancelled and get what is left of ``timeout``, at least
        :data:`LOOP_CLOSE_GRACE`, to end.
        """
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
        with self._ready:
            self._closing = True
            self._stalls.notify()
            self._tasks.extend([None] * len(threads))
            self._wake_locked(len(threads))
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        exited = not any(thread.is_alive() for thread in threads)
        closed = self.event_loop.close(max(LOOP_CLOSE_GRACE, deadline - time.monotonic()))
        return exited and closed

    def tasks_started(self) -> int:
        """How many tasks the calling thread has started, if it is one of the pool's (0 on
        any other thread): a task tells by it whether its thread ran another since."""
        return getattr(self._local, "started", 0)

    def _loop(self) -> None:
        opened: dict[str, tuple[int, float]] = {}
        stopped = False
        self.event_loop.bind()
        self._local.started = 0
        thread_connections.starts_without_connections()
        try:
            while (task := self._take()) is not None:
                self._local.started += 1
                with self._lock:
                    self._busy += 1
                try:
                    task()
                except BaseException:  # the task handles its own errors; this is a last guard
                    logger.exception("handler task crashed")
                finally:
                    with self._lock:
                        self._busy -= 1
                    self._recycle(opened)
            stopped = True
        finally:
            try:
                connections.close_all()
            finally:
                if not stopped and not self._stopping:
                    logger.error("handler thread %s died; starting another", _current_name())
                    self._start_thread()

    @property
    def alive(self) -> int:
        """Handler threads alive now (for tests and health)."""
        with self._lock:
            return sum(thread.is_alive() for thread in self._threads)

    @property
    def busy(self) -> int:
        """Threads running a task now: a sync job, or the steps of an async one."""
        with self._lock:
            return self._busy

    def _recycle(self, opened: dict[str, tuple[int, float]]) -> None:
        """After a job: keep healthy connections, close broken, dirty or old ones."""
        now = time.monotonic()
        kept = False
        for conn in thread_connections.open_connections():
            raw = conn.connection
            if raw is None:
                opened.pop(conn.alias, None)
                continue
            since = opened.get(conn.alias)
            if since is None or since[0] != id(raw):
                since = opened[conn.alias] = (id(raw), now)
            broken = conn.errors_occurred and not conn.is_usable()
            dirty = conn.in_atomic_block or not conn.get_autocommit() or not raw.autocommit
            if broken or dirty or now - since[1] >= self._max_age:
                conn.close()
                opened.pop(conn.alias, None)
            else:
                conn.errors_occurred = False
                kept = True
        if not kept:  # none left open: the next job's checks are skipped until one opens
            thread_connections.starts_without_connections()


def _current_name() -> str:
    return threading.current_thread().name
