"""Wake idle workers the moment work is enqueued, through PostgreSQL LISTEN/NOTIFY.

Enqueue notifies the channel with the job's type name at commit. The listener holds its own
connection (outside Django's, which may sit in a transaction) and wakes the run loop when a
name it runs arrives. The run loop polls on its interval all the same: the listener only makes
pickup faster, never correct.

A LISTEN is worth something only if notifications come back on it, and is safe only on a
connection that owns its server session. Behind a pooler (PgBouncer and the like) neither need
hold: in transaction mode the pooler runs the LISTEN on whichever server connection it picked,
then lends that connection to other clients, and what arrives there is dropped or handed to a
stranger; a LISTEN sent there stays there, whatever the listener does next (its process may be
killed before it can undo it). So no LISTEN is sent before the connection proves it is the
session's own, by a question that leaves nothing behind, and the listener counts as
listening only once a probe comes back::

    connect ─▶ is the backend that answers the one the connection was opened with?
       ▲          │ no: a pooler stands between ─▶ warn once, poll only (nothing was sent)
       │          ▼ yes
       │       LISTEN ─▶ probe: NOTIFY from a second connection
       │          │ the same backend, the probe back within PROBE_TIMEOUT ─▶ listening
       │          │ else: UNLISTEN on that backend if it can be reached, warn once, poll only
       │          ▼
       └── a lost connection: retry at once, backing off; a failed proof: REPROVE_AFTER

A working listener is not re-proved while its connection lives: a direct session cannot stop
delivering without failing, and keepalives (:mod:`jobs.db.bounds`) turn a dead path into an
error, which reconnects and proves again.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

from jobs.core.conf import NOTIFY_CHANNEL
from jobs.db import bounds as dbbounds
from jobs.db import sessions
from jobs.worker import metrics

logger = logging.getLogger("jobs.worker")

# How often the listener looks up from its socket to see whether it was asked to stop.
_STOP_CHECK = 0.1
#: How long a probe NOTIFY may take to come back before LISTEN counts as not working.
PROBE_TIMEOUT = 3.0
#: After a failed proof, how long the worker polls before it tries LISTEN again (seconds).
REPROVE_AFTER = 300.0
# How long the listener tries to reach the backend that holds a failed LISTEN, to undo it.
_UNLISTEN_FOR = 1.0


class NotifyListener:
    """The listener thread: ``listening`` is set while a proven LISTEN delivers notices."""

    def __init__(
        self,
        names: Collection[str],
        on_work: Callable[[str], None],
        *,
        poll_interval: float = 0.5,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self._names = frozenset(names)
        self._using = using  # the database alias whose notifications wake the worker
        self._on_work = on_work
        self._poll_interval = poll_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jobs-listener", daemon=True)
        self.listening = threading.Event()
        #: Set while the last proof failed: the worker finds new work by polling only.
        self.unproven = threading.Event()
        self._warned = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started when NOTIFY is off
            self._thread.join(timeout)
        self.listening.clear()
        metrics.listening.set(0)

    def _loop(self) -> None:
        retry = 0.5
        while not self._stop.is_set():
            try:
                proven = self._listen()
                retry = 0.5
            except psycopg.Error as exc:
                self.listening.clear()
                metrics.listening.set(0)
                logger.warning("LISTEN connection failed (%s); polling until it is back", exc)
                if self._stop.wait(retry):
                    return
                retry = min(retry * 2, 30.0)
                continue
            if not proven and self._stop.wait(REPROVE_AFTER):
                return

    def _listen(self) -> bool:
        """Listen until stopped; False at once when the proof fails."""
        # Keepalives make a dead network path under this idle connection show up as an error.
        params = dbbounds.connect_params(
            connections[self._using], application_name="jobs-worker listener"
        )
        with _connect(params) as conn:
            if not _owns_its_session(conn):
                self._fall_back(undone=True, pooled=True)
                return False
            with conn.transaction():
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                backend = _backend(conn)
            # A LISTEN that is not proved is undone however the proof ended (a stop, an
            # error): behind a pooler it would stay on a backend lent to other clients.
            try:
                proven = self._prove(conn, backend, params)
            except BaseException:
                with contextlib.suppress(psycopg.Error):
                    _unlisten(conn, backend)
                raise
            if not proven:
                undone = _unlisten(conn, backend)
                if self._stop.is_set():
                    return True
                self._fall_back(undone)
                return False
            self._proved()
            while not self._stop.is_set():
                # A short wait, so a stop (the end of every run_worker() in tests) is not held
                # up: an idle wait costs one poll() of the socket, no round trip.
                for notice in conn.notifies(timeout=_STOP_CHECK):
                    if notice.payload in self._names:
                        self._on_work(notice.payload)
        return True

    def _prove(self, conn: psycopg.Connection[Any], backend: int, params: dict[str, Any]) -> bool:
        """Send a probe NOTIFY from another connection; True once it comes back on ``conn``.

        From another connection, as enqueue's notices come: behind a pooler, a probe sent
        on the listening connection could run on the very backend that listens and come
        back, while no one else's would. And nothing is sent on ``conn`` once the probe is
        out: behind a pooler, that statement could land on the backend that listens and
        bring the probe's notice back with its answer, which a listener waiting for work,
        sending nothing, never gets. The probe and its way back share PROBE_TIMEOUT.
        """
        if _backend(conn) != backend:
            return False  # the session moved between two statements: transaction pooling
        token = f"probe {secrets.token_hex(8)}"  # a space: no job type has this name
        deadline = time.monotonic() + PROBE_TIMEOUT
        if not self._send_probe(params, token, deadline):
            return False
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            for notice in conn.notifies(timeout=min(left, _STOP_CHECK)):
                if notice.payload == token:
                    return True
                if notice.payload in self._names:
                    self._on_work(notice.payload)
        return False

    def _send_probe(self, params: dict[str, Any], token: str, deadline: float) -> bool:
        """Send the probe from a connection of its own; False if a stop or ``deadline`` came
        first. Raises what the probe's connection raised.

        A pooler with no free server queues the probe's statement, for minutes
        (PgBouncer's ``query_wait_timeout``): the probe runs in a thread of its own, so that
        neither a stop nor the proof waits for it. One left behind ends with the pooler's
        timeout, or runs once a server frees; its notice is then nobody's.
        """
        done = threading.Event()
        failed: list[BaseException] = []

        def send() -> None:
            try:
                probe_params = {**params, "application_name": "jobs-worker listener probe"}
                with _connect(probe_params) as probe:
                    probe.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, token])
            except BaseException as exc:  # handed to the listener's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=send, name="jobs-listener-probe", daemon=True).start()
        while not done.wait(min(max(deadline - time.monotonic(), 0.0), _STOP_CHECK)):
            if self._stop.is_set() or time.monotonic() >= deadline:
                return False
        if failed:
            raise failed[0]
        return True

    def _proved(self) -> None:
        if self.unproven.is_set():
            logger.info(
                "LISTEN delivers notifications again: new work wakes the worker at once",
                extra={"action": "listen_proven"},
            )
        self._warned = False
        self.unproven.clear()
        self.listening.set()
        metrics.listening.set(1)

    def _fall_back(self, undone: bool, pooled: bool = False) -> None:
        """Poll from now on; warn once. ``pooled``: a pooler was seen, no LISTEN was sent."""
        self.listening.clear()
        self.unproven.set()
        metrics.listening.set(0)
        if self._warned:
            logger.debug("LISTEN still delivers no notifications; polling on")
            return
        self._warned = True
        if pooled:
            why = (
                "LISTEN delivers no notifications through a connection pooler, and this "
                "database connection goes through one (the server process that answers is not "
                "the one the connection was opened with): no LISTEN was sent, which the pooler "
                "would leave on a server connection it lends to other clients."
            )
        else:
            why = (
                "LISTEN delivers no notifications on this database connection (a "
                "transaction-mode pooler such as PgBouncer?)."
            )
        logger.warning(
            "%s Polling for new work every %gs instead. Run the worker with --no-listen, or "
            'set JOBS["NOTIFY"] = False, to poll without this check; connect it to PostgreSQL '
            "directly to be woken at once. Trying LISTEN again in %d minutes.%s",
            why,
            self._poll_interval,
            round(REPROVE_AFTER / 60),
            ""
            if undone
            else " The pooler may keep the LISTEN on one of its server "
            "connections until it recycles it (server_lifetime).",
            extra={"action": "listen_unavailable", "pooled": pooled},
        )


def _connect(params: dict[str, Any]) -> psycopg.Connection[Any]:
    """An autocommit connection (``params`` from ``dbbounds.connect_params``: never prepares)."""
    return psycopg.connect(**params, autocommit=True)


def _owns_its_session(conn: psycopg.Connection[Any]) -> bool:
    """Whether the backend that answers on ``conn`` is the one the connection was opened with
    (:func:`jobs.db.sessions.owns_its_session`), through :func:`_backend`, which the proof
    also reads."""
    return conn.info.backend_pid == _backend(conn)


def _backend(conn: psycopg.Connection[Any]) -> int:
    return sessions.backend_pid(conn)


def _unlisten(conn: psycopg.Connection[Any], backend: int) -> bool:
    """UNLISTEN on ``backend``, which a pooler lends to other clients; True once done.

    Left there, every notice that backend receives is handed to whichever client holds it
    then, and psycopg keeps notices a connection does not read. The pooler picks the backend
    of each transaction, so ask until it is the one (``UNLISTEN`` elsewhere changes nothing).
    """
    deadline = time.monotonic() + _UNLISTEN_FOR
    while True:
        with conn.transaction():
            conn.execute("UNLISTEN *")
            if _backend(conn) == backend:
                return True
        if time.monotonic() > deadline:
            return False
