"""Leadership: any number of schedulers run, one acts, and PostgreSQL decides which.

The leader holds a session-level advisory lock on a dedicated psycopg connection (not
Django's, which may be closed or recycled between requests)::

                       pg_try_advisory_lock(key) = true
    start ──▶ standby ─────────────────────────────────────▶ leader ──┐ prove (≤ 1 s, and
                ▲  │                                           │      │ before every duty):
                │  └─ false or no connection:                  │ ◀────┘ our session still
                │     retry every standby interval             │        holds the lock
                └──── proof failed / no answer / connection ───┘
                      lost / the duty loop stuck for the timeout
                          (close the connection, stop acting)
    leader ──SIGTERM──▶ unlock, close ──▶ stopped      (a standby takes over at its next try)

Why each step:

* A leader killed outright (``kill -9``, host loss) closes its socket; PostgreSQL ends the
  session and the lock goes with it, so a standby wins its next try.
* A leader that stalls (SIGSTOP, a long GC pause, a network cut) stops proving. Its session
  sets ``idle_session_timeout`` to ``JOBS["SCHEDULER_LEADER_TIMEOUT"]``, so the server ends it
  and frees the lock; when the old leader wakes, its proof fails and it stands down.
* A leader whose process is alive but whose duty loop is stuck in a call would go on proving
  from the keeper thread for ever. The scheduler's stall guard calls :meth:`Leadership.step_down`
  once its loop has not moved for the timeout (see :mod:`jobs.scheduler.runner`).
* Every call on the lock session has a client-side deadline (half the timeout): on a path that
  went silent, the proof fails instead of hanging, and the leader stands down.
* Between a proof and the work it allows, leadership could still be lost. The cron tick
  therefore checks, inside its own transaction, that the lock session is still the lock's
  holder (:meth:`Leadership.fence`), and the slot table's unique constraint is the last word.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

from jobs import dbbounds
from jobs.conf import jobs_settings
from jobs.scheduler import metrics

logger = logging.getLogger("jobs.scheduler")

#: The advisory lock the leader holds ("jobs/sch" as a 64-bit key).
LOCK_KEY = int.from_bytes(b"jobs/sch", "big")

_HELD = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND pid = {pid}
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %(classid)s::bigint::oid AND objid = %(objid)s::bigint::oid
      AND objsubid = 1
)"""
PROOF_SQL = _HELD.format(pid="pg_backend_pid()")
FENCE_SQL = _HELD.format(pid="%(pid)s")


class LeadershipLost(Exception):
    """This process can no longer prove it leads; whatever it was doing must not commit."""


class Leadership:
    """The advisory-lock leadership of one scheduler process."""

    def __init__(
        self,
        identity: str,
        *,
        key: int = LOCK_KEY,
        timeout: timedelta | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self.identity = identity
        self.key = key
        self.using = using
        self.timeout = timeout or jobs_settings.SCHEDULER_LEADER_TIMEOUT
        # Prove several times per timeout, so a live leader's session is never idle that long.
        self.proof_interval = min(1.0, self.timeout.total_seconds() / 5)
        # A call on the lock session with no answer this long is cut off (dbbounds.deadline).
        self.call_deadline = max(0.5, self.timeout.total_seconds() / 2)
        self.backend_pid: int | None = None
        self._params = {"classid": key >> 32, "objid": key & 0xFFFFFFFF}
        self._mutex = threading.RLock()
        self._conn: psycopg.Connection | None = None
        self._leading = False
        self._standby_announced = False
        self._unreachable = False
        self._term = 0  # counts acquisitions, so each term's keeper thread knows when it ends
        self._closing = threading.Event()

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def reachable(self) -> bool:
        """False once the last attempt to contend could not reach the database."""
        return not self._unreachable

    def try_acquire(self) -> bool:
        """Take the lock if no one holds it; True while this process leads."""
        with self._mutex:
            if self._leading:
                return True
            got = self._try_lock()
            if not got:
                if got is False and not self._standby_announced:
                    logger.info(
                        "scheduler %s stands by: another scheduler leads",
                        self.identity,
                        extra={"action": "standby"},
                    )
                    self._standby_announced = True
                return False
            self._leading = True
            self._standby_announced = False
            self._term += 1
            self.backend_pid = self._conn.info.backend_pid if self._conn else None
        metrics.leader.set(1)
        metrics.leadership_changes.labels("acquired").inc()
        logger.info(
            "scheduler %s is now the leader (lock session pid %s)",
            self.identity,
            self.backend_pid,
            extra={"action": "leader_acquired"},
        )
        keeper = threading.Thread(
            target=self._keep, args=(self._term,), name="jobs-leadership", daemon=True
        )
        keeper.start()
        return True

    def prove(self) -> bool:
        """Check on the lock's own session that it still holds the lock; step down if not."""
        with self._mutex:
            if not self._leading or self._conn is None:
                return False
            try:
                held = bool(self._call(PROOF_SQL, self._params)[0])
                reason = "its session no longer holds the lock"
            except psycopg.Error as exc:
                held, reason = False, f"the lock connection failed ({exc})".strip()
            if not held:
                self._step_down(reason)
            return held

    def fence(self, using: str | None = None) -> None:
        """Raise :class:`LeadershipLost` unless the lock session still holds the lock.

        Runs on the caller's connection, inside the caller's transaction, so the check and
        the work it guards commit together or not at all.
        """
        pid = self.backend_pid
        if not self._leading or pid is None:
            raise LeadershipLost(f"scheduler {self.identity} is not the leader")
        with connections[using or self.using].cursor() as cur:
            cur.execute(FENCE_SQL, {**self._params, "pid": pid})
            if not cur.fetchone()[0]:
                raise LeadershipLost(f"lock session pid {pid} no longer holds the leader lock")

    def step_down(self, reason: str) -> bool:
        """Stop leading now, closing the lock session; True if this process was leading."""
        with self._mutex:
            if not self._leading:
                return False
            self._step_down(reason)
            return True

    def release(self) -> None:
        """Give up leadership (at shutdown) so a standby takes over at once."""
        self._closing.set()
        with self._mutex:
            was_leading = self._leading
            if was_leading and self._conn is not None:
                with contextlib.suppress(psycopg.Error):  # closing the session releases it too
                    self._call("SELECT pg_advisory_unlock(%s)", [self.key])
            self._close()
            self._leading = False
        if was_leading:
            metrics.leader.set(0)
            metrics.leadership_changes.labels("released").inc()
            logger.info(
                "scheduler %s released leadership",
                self.identity,
                extra={"action": "leader_released"},
            )

    # -- internals ---------------------------------------------------------------------------

    def _try_lock(self) -> bool | None:
        """True: locked; False: someone else holds it; None: the database is unreachable."""
        for attempt in range(2):  # a stale standby connection gets one fresh retry
            try:
                self._connection()
                got = self._call("SELECT pg_try_advisory_lock(%s)", [self.key])[0]
                self._unreachable = False
                return bool(got)
            except psycopg.Error as exc:
                self._close()
                if attempt and not self._unreachable:  # once per outage, not every attempt
                    self._unreachable = True
                    logger.warning(
                        "scheduler %s cannot reach the database to contend for leadership: %s",
                        self.identity,
                        str(exc).strip(),
                        extra={"action": "leader_unreachable"},
                    )
        return None

    def _step_down(self, reason: str) -> None:
        self._close()
        self._leading = False
        metrics.leader.set(0)
        metrics.leadership_changes.labels("lost").inc()
        logger.warning(
            "scheduler %s lost leadership: %s; stopped acting",
            self.identity,
            reason,
            extra={"action": "leader_lost"},
        )

    def _keep(self, term: int) -> None:
        """Prove leadership on a timer, so a live leader's session never idles out."""
        while not self._closing.wait(self.proof_interval):
            if term != self._term or not self._leading or not self.prove():
                return  # this term of leadership ended (a later one has its own keeper)

    def _call(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> tuple[Any, ...]:
        """One statement on the lock session, cut off if no answer comes within its deadline.

        A silent network path would otherwise hang the keeper (and the loop, waiting for the
        mutex) for good, still claiming to lead.
        """
        assert self._conn is not None
        with dbbounds.deadline(self._conn, self.call_deadline):
            row = self._conn.execute(sql, params).fetchone()
        assert row is not None  # each statement here SELECTs one function call: one row
        return row

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            params = dbbounds.connect_params(
                self.using, application_name=f"jobs-scheduler {self.identity}"
            )
            params["connect_timeout"] = min(params.get("connect_timeout", 5), 5)
            self._conn = psycopg.connect(**params, autocommit=True)
            timeout_ms = int(self.timeout.total_seconds() * 1000)
            try:
                self._call(
                    "SELECT set_config('idle_session_timeout', %s, false)", [str(timeout_ms)]
                )
            except psycopg.errors.UndefinedObject:
                logger.warning(
                    "PostgreSQL has no idle_session_timeout (before 14): a stalled leader keeps "
                    "leadership until its connection closes"
                )
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self.backend_pid = None
