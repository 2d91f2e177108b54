"""Leadership: any number of schedulers run, one acts, and PostgreSQL decides which.

The leader holds a transaction-level advisory lock in one transaction that stays open for its
whole term, on a dedicated psycopg connection (not Django's, which may be closed or recycled
between requests)::

                       BEGIN; pg_try_advisory_xact_lock(key) = true
    start ──▶ standby ─────────────────────────────────────────▶ leader ──┐ prove (≤ 1 s, and
                ▲  │                                               │      │ before every duty):
                │  └─ false (ROLLBACK) or no connection:           │ ◀────┘ our transaction
                │     retry every standby interval                 │        still holds the lock
                └──── proof failed / no answer / connection ───────┘
                      lost / the duty loop stuck for the timeout
                          (close the connection, stop acting)
    leader ──SIGTERM──▶ ROLLBACK, close ──▶ stopped   (a standby takes over at its next try)

Why a transaction and not a session: a pooler in transaction mode (PgBouncer) gives a client
one server connection for the length of a transaction and may give it another for the next.
A session-level lock would stay behind on a server connection that other clients then use
(one of them would "re-take" it and lead too), and the proofs would run on other backends.
Inside one open transaction the lock, its proof (by ``pg_backend_pid()``) and the fence (by
that pid and the term's virtual transaction id) all mean the same, directly or through the
pooler. A pid alone would not do for the fence: the operating system hands pids out again
(often from only 32768), so the backend of a later leader's lock session can get the pid of a
stale leader's ended term, while a virtual transaction id is not reused. The term costs
nothing while it lasts: READ COMMITTED, no transaction id, and a proof that reads
``pg_lock_status()`` rather than catalogs, so between proofs the session holds no snapshot
(vacuum is not held back) and no lock but the advisory one (no DDL waits for it).

Why each step:

* A leader killed outright (``kill -9``, host loss) closes its socket; PostgreSQL (or the
  pooler, which drops a server connection whose client left mid-transaction) ends the session
  and the lock goes with it, so a standby wins its next try.
* A leader that stalls (SIGSTOP, a long GC pause, a network cut) stops proving. Its term sets
  ``idle_in_transaction_session_timeout`` to ``JOBS["SCHEDULER_LEADER_TIMEOUT"]`` (LOCAL:
  nothing outlives the transaction on a pooled connection), so the server ends it and frees
  the lock; when the old leader wakes, its proof fails and it stands down.
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

from jobs.core.conf import jobs_settings
from jobs.db import bounds as dbbounds
from jobs.scheduler import metrics

logger = logging.getLogger("jobs.scheduler")

#: The advisory lock the leader holds ("jobs/sch" as a 64-bit key).
LOCK_KEY = int.from_bytes(b"jobs/sch", "big")

# The term's start: BEGIN and its first statement in one query, so the server never waits
# inside the term under the role's own idle_in_transaction_session_timeout (none by default,
# or one shorter than a round trip). Its bound is set before the lock is tried, in the same
# statement, so no moment of the term is unbounded; a transaction_timeout (PostgreSQL 17+)
# set for the role or database would end every term, so the term turns it off for itself.
# The last column is the term's virtual transaction id (from the lock every transaction
# holds on its own), which names this term for the fence.
ACQUIRE_SQL = """
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT set_config('idle_in_transaction_session_timeout', %(timeout)s, true),
       CASE WHEN current_setting('transaction_timeout', true) IS NOT NULL
            THEN set_config('transaction_timeout', '0', true) END,
       pg_try_advisory_xact_lock(%(key)s),
       pg_backend_pid(),
       (SELECT l.virtualtransaction FROM pg_lock_status() AS l
        WHERE l.locktype = 'virtualxid' AND l.pid = pg_backend_pid()
          AND l.virtualxid = l.virtualtransaction)"""

# On the lock session, inside the term. pg_lock_status() is the function behind the pg_locks
# view: reading it takes no relation lock, which the term would otherwise keep to its end
# (the view's and pg_database's, which VACUUM FULL or a REINDEX of it would queue behind).
# The pid names our own backend, so the database needs no check.
PROOF_SQL = """
SELECT EXISTS (
    SELECT 1 FROM pg_lock_status() AS l
    WHERE l.locktype = 'advisory' AND l.granted AND l.pid = pg_backend_pid()
      AND l.classid = %(classid)s::bigint::oid AND l.objid = %(objid)s::bigint::oid
      AND l.objsubid = 1
)"""

# On the caller's connection, inside the caller's (short) transaction: the lock is held by
# our term, not merely by a backend with our term's pid.
FENCE_SQL = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND pid = %(pid)s
      AND virtualtransaction = %(term)s
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %(classid)s::bigint::oid AND objid = %(objid)s::bigint::oid
      AND objsubid = 1
)"""


class LeadershipLost(Exception):
    """This process can no longer prove it leads; whatever it was doing must not commit."""


class Leadership:
    """The advisory-lock leadership of one scheduler process (one open transaction a term)."""

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
        self.term_id: str | None = None  # the term's virtual transaction id, for the fence
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
            self._closing.clear()  # a release ended the last term's keeper, not this one's
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
                held = bool(self._fetch(PROOF_SQL, self._params)[0])
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
        pid, term = self.backend_pid, self.term_id
        if not self._leading or pid is None or term is None:
            raise LeadershipLost(f"scheduler {self.identity} is not the leader")
        with connections[using or self.using].cursor() as cur:
            cur.execute(FENCE_SQL, {**self._params, "pid": pid, "term": term})
            if not cur.fetchone()[0]:
                raise LeadershipLost(
                    f"lock session pid {pid} (term {term}) no longer holds the leader lock"
                )

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
                # Ending the term frees the lock (closing would too, but a pooler then drops
                # the server connection instead of taking it back).
                with contextlib.suppress(psycopg.Error):
                    self._send("ROLLBACK")
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
        timeout = str(int(self.timeout.total_seconds() * 1000))
        for attempt in range(2):  # a stale standby connection gets one fresh retry
            try:
                self._connection()
                cur = self._send(ACQUIRE_SQL, {"timeout": timeout, "key": self.key})
                cur.nextset()  # past BEGIN's result to the SELECT's
                row = cur.fetchone()
                assert row is not None  # a SELECT of function calls: one row
                *_, got, pid, term = row
                if got:
                    self.backend_pid = pid  # the server's; a pooler's BackendKeyData is its own
                    self.term_id = term
                else:
                    self._send("ROLLBACK")  # a standby holds no transaction (nor, pooled, a server)
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

    def _send(
        self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None
    ) -> psycopg.Cursor[Any]:
        """One statement on the lock session, cut off if no answer comes within its deadline.

        A silent network path would otherwise hang the keeper (and the loop, waiting for the
        mutex) for good, still claiming to lead.
        """
        assert self._conn is not None
        with dbbounds.deadline(self._conn, self.call_deadline):
            return self._conn.execute(sql, params)

    def _fetch(self, sql: str, params: Mapping[str, Any]) -> tuple[Any, ...]:
        row: tuple[Any, ...] | None = self._send(sql, params).fetchone()
        assert row is not None  # each statement here SELECTs function calls: one row
        return row

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            params = dbbounds.connect_params(
                self.using, application_name=f"jobs-scheduler {self.identity}"
            )
            params["connect_timeout"] = min(params.get("connect_timeout", 5), 5)
            # Autocommit: the term's BEGIN and ROLLBACK are ours to send. Client-side binding:
            # each statement goes as a simple query, whose portal (and snapshot) the server
            # drops when it ends; a bound one's unnamed portal would keep its snapshot, and
            # with it the term's xmin, until the next statement. (connect_params: never
            # prepared, as a standby's tries land on any server connection of a pool.)
            self._conn = psycopg.connect(
                **params,
                autocommit=True,
                cursor_factory=psycopg.ClientCursor,
            )
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self.backend_pid = self.term_id = None
