"""Wake idle workers the moment work is enqueued, through PostgreSQL LISTEN/NOTIFY.

Enqueue notifies the channel with the job's type name at commit. The listener holds its own
connection (outside Django's, which may sit in a transaction) and wakes the run loop when a
name it runs arrives. If the connection fails, or notifications never come (a transaction-
mode pooler drops them), the run loop still polls on its interval: the listener only makes
pickup faster, never correct.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

import psycopg
from django.db import connection

from jobs import dbbounds
from jobs.conf import NOTIFY_CHANNEL

logger = logging.getLogger("jobs.worker")

# How often the listener looks up from its socket to see whether it was asked to stop.
_STOP_CHECK = 0.1


class NotifyListener:
    def __init__(self, names: Collection[str], on_work: Callable[[str], None]) -> None:
        self._names = frozenset(names)
        self._on_work = on_work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jobs-listener", daemon=True)
        self.listening = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started when NOTIFY is off
            self._thread.join(timeout)

    def _loop(self) -> None:
        retry = 0.5
        while not self._stop.is_set():
            try:
                self._listen()
                retry = 0.5
            except psycopg.Error as exc:
                self.listening.clear()
                logger.warning("LISTEN connection failed (%s); polling until it is back", exc)
                if self._stop.wait(retry):
                    return
                retry = min(retry * 2, 30.0)

    def _listen(self) -> None:
        # Keepalives make a dead network path under this idle connection show up as an error.
        params = dbbounds.connect_params(connection, application_name="jobs-worker listener")
        with psycopg.connect(**params, autocommit=True) as conn:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self.listening.set()
            while not self._stop.is_set():
                # A short wait, so a stop (the end of every run_worker() in tests) is not held
                # up: an idle wait costs one poll() of the socket, no round trip.
                for notice in conn.notifies(timeout=_STOP_CHECK):
                    if notice.payload in self._names:
                        self._on_work(notice.payload)
