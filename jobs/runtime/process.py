"""Plumbing shared by the long-running commands (worker, scheduler): signals, HTTP, presence."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS

if TYPE_CHECKING:
    from jobs.queue.types import ProcessBeat


def install_stop_signals(stop: Callable[[], None], enabled: bool = True) -> dict[int, Any]:
    """Route SIGTERM and SIGINT to ``stop``; returns the previous handlers to restore.

    Signal handlers can only be set from the main thread; elsewhere (tests running a loop in
    a thread, the test helper) this does nothing and the caller stops the loop itself.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGTERM, signal.SIGINT)}


def restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def start_http(
    host: str, port: int | None, *, healthy: Callable[[], bool], ready: Callable[[], bool]
) -> ThreadingHTTPServer | None:
    """The private health and metrics listener, when a port is configured."""
    if port is None:
        return None
    from jobs.runtime.http import start_http_server

    return start_http_server(host, port, healthy=healthy, ready=ready)


def process_identity() -> str:
    """``host:pid:nonce``: a pid the host reuses, or pid 1 in every container, never collides.

    Shown in logs, in ``claimed_by`` of the jobs a worker holds, in slot rows, in
    ``pg_stat_activity.application_name``, and as the key of the process's row.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(2)}"


class Presence:
    """A long-running process's row in ``jobs_process``: registered, beaten, removed.

    Nothing here may stop the process: the registry is for people. A registration the
    database refused is tried again at the next beat; a failed beat or unregistration is
    logged (once per outage) and the row shows as gone once it expires.
    """

    def __init__(
        self,
        identity: str,
        *,
        component: str,
        expires_in: float,
        scope: str = "",
        concurrency: int | None = None,
        logger: logging.Logger | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self.identity = identity
        self.using = using  # the database alias whose jobs_process holds the row
        self.component = component
        self.expires_in = expires_in
        self.scope = scope
        self.concurrency = concurrency
        self.registered = False
        self._logger = logger or logging.getLogger("jobs")
        self._failing = False

    def register(self) -> bool:
        """Insert (or replace) this process's row; True once it is there."""
        from jobs import __version__
        from jobs.queue import processes

        try:
            processes.register(
                self.identity,
                component=self.component,
                host=socket.gethostname(),
                pid=os.getpid(),
                version=__version__,
                scope=self.scope,
                concurrency=self.concurrency,
                expires_in=self.expires_in,
                using=self.using,
            )
        except Exception as exc:
            self._failed("register", exc)
            return False
        self._failing = False
        self.registered = True
        return True

    def beat(
        self, *, held: int = 0, draining: bool = False, leader: bool = False
    ) -> ProcessBeat | None:
        """The :class:`~jobs.queue.ProcessBeat` to send now, or None while unregistered.

        Registers first when the last attempt failed (on the calling thread's connection).
        """
        from jobs.queue.types import ProcessBeat

        if not self.registered and not self.register():
            return None
        return ProcessBeat(self.identity, held, draining, self.expires_in, leader)

    def forget(self) -> None:
        """The row is gone (pruned while this process stalled): register at the next beat."""
        self.registered = False

    def send(self, *, leader: bool = False) -> bool:
        """Beat in a statement of its own (the scheduler's); True if the row was refreshed."""
        from jobs.queue import processes

        for _ in range(2):  # a row found missing (pruned in a long stall) is registered anew
            beat = self.beat(leader=leader)
            if beat is None:
                return False
            try:
                found = processes.beat(beat, using=self.using)
            except Exception as exc:
                self._failed("beat", exc)
                return False
            self._failing = False
            if found:
                return True
            self.registered = False
        return False

    def unregister(self) -> None:
        """Remove the row on a clean stop (a no-op when it was never registered)."""
        from jobs.queue import processes

        if not self.registered:
            return
        try:
            processes.unregister(self.identity, using=self.using)
        except Exception as exc:
            self._failed("unregister", exc)
            return
        self.registered = False

    def _failed(self, what: str, exc: BaseException) -> None:
        from django.db import connections

        with contextlib.suppress(Exception):  # as after any failed call: reconnect next time
            connections[self.using].close()
        if not self._failing:
            self._logger.warning(
                "could not %s process %s in jobs_process (%s: %s); the processes page may "
                "show it stale or gone meanwhile",
                what,
                self.identity,
                type(exc).__name__,
                (str(exc).strip().splitlines() or [""])[0],
                extra={"action": "process_registry_failed"},
            )
        self._failing = True
