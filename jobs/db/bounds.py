"""Bounds on every database call of the worker's and the scheduler's own connections.

A loop that keeps the queue moving must never wait forever on the database. Each way a call
can get stuck has its own bound::

    stuck where                            bound                              what happens
    ─────────────────────────────────────  ─────────────────────────────────  ──────────────────
    a statement runs or waits on the       statement_timeout                  the server cancels
      server (a long scan, pg_sleep)         (JOBS["DB_STATEMENT_TIMEOUT"])     it; the loop retries
    a statement waits for a lock           lock_timeout ("DB_LOCK_TIMEOUT")   the same
    the network path died (packets lost)   tcp_user_timeout + TCP keepalives  the kernel drops the
                                             ("DB_NETWORK_TIMEOUT")             connection
    opening a connection                   connect_timeout (the same)         libpq gives up
    anywhere else: a hung proxy or pooler  abort() from another thread, via   the socket is shut
      keeps TCP happy, no answer comes       deadline() or a StallGuard         down; the call
                                                                                raises at once

How the timeouts are applied: as libpq connection parameters of our own connections, never as
a ``SET``. ``options`` carries ``-c statement_timeout=… -c lock_timeout=…`` in the startup
packet, so PostgreSQL sets them as the session starts, a reconnect gets them again, and no
command ever leaves them behind on a pooled server connection that another client gets next.
(PgBouncer 1.20+ in transaction mode applies such ``-c`` settings per client when they are in
its ``track_extra_parameters``; older ones refuse ``options`` unless it is in
``ignore_startup_parameters``, which drops the two timeouts: the TCP bounds still apply.)

Handler threads keep the project's plain settings: :func:`bound` gives one thread's Django
connection a copy of the settings with the bounds, and user code never runs on it.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionProxy

from jobs.core.conf import jobs_settings

# Django's connection parameters that psycopg.connect() does not take.
DJANGO_ONLY_PARAMS = ("cursor_factory", "context", "server_side_binding", "prepare_threshold")
_PLAIN = "_jobs_unbounded_settings"  # where bound() keeps a connection's own settings dict

type ConnectionRef = BaseDatabaseWrapper | ConnectionProxy[BaseDatabaseWrapper] | str


@dataclass(frozen=True)
class Bounds:
    """The three bounds; a zero leaves that one to the server's (or the OS's) default."""

    statement_timeout: timedelta | float = timedelta(seconds=5)
    lock_timeout: timedelta | float = timedelta(seconds=2)
    network_timeout: timedelta | float = timedelta(seconds=10)

    @classmethod
    def from_settings(cls) -> Bounds:
        return cls(
            jobs_settings.DB_STATEMENT_TIMEOUT,
            jobs_settings.DB_LOCK_TIMEOUT,
            jobs_settings.DB_NETWORK_TIMEOUT,
        )

    def libpq_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` (Django ``OPTIONS`` or psycopg keywords) with the bounds added."""
        params = dict(params)
        flags = [
            f"-c {name}={milliseconds}"
            for name, milliseconds in (
                ("statement_timeout", _ms(self.statement_timeout)),
                ("lock_timeout", _ms(self.lock_timeout)),
            )
            if milliseconds
        ]
        if flags:
            params["options"] = " ".join(filter(None, [params.get("options", ""), *flags]))
        network = _seconds(self.network_timeout)
        if network:
            # Probes start halfway and end by the timeout (idle + count * interval); Linux
            # drops the connection once tcp_user_timeout passes without an acknowledgement.
            params.update(
                keepalives=1,
                keepalives_idle=max(1, int(network // 2)),
                keepalives_interval=max(1, int(network // 6)),
                keepalives_count=3,
                tcp_user_timeout=int(network * 1000),
            )
            params.setdefault("connect_timeout", max(2, math.ceil(network)))
        return params


def bound(
    connection: ConnectionRef = DEFAULT_DB_ALIAS, bounds: Bounds | None = None
) -> BaseDatabaseWrapper:
    """Give the calling thread's Django connection the bounds, from its next connect on.

    Only this thread's connection object changes (Django keeps one per thread); an open
    connection is closed so that its next use reconnects bounded. It never comes from a
    ``"pool"`` in ``OPTIONS``, whose connections handler threads share, and never prepares
    statements by count, whatever ``OPTIONS`` say (the queue's own are prepared when
    ``JOBS["PREPARED_STATEMENTS"]`` is on). Returns the connection.
    """
    wrapper = _wrapper(connection)
    if wrapper.in_atomic_block:
        raise RuntimeError("cannot bound a database connection inside a transaction")
    plain = getattr(wrapper, _PLAIN, None) or wrapper.settings_dict
    options = (bounds or Bounds.from_settings()).libpq_params(plain["OPTIONS"])
    options.pop("pool", None)
    # Never prepared by count, as connect_params, whatever the alias's OPTIONS set for the web
    # processes; the queue's statements are prepared only as JOBS["PREPARED_STATEMENTS"] says.
    options["prepare_threshold"] = None
    wrapper.close()
    setattr(wrapper, _PLAIN, plain)
    wrapper.settings_dict = {**plain, "OPTIONS": options}
    return wrapper


def unbound(connection: ConnectionRef = DEFAULT_DB_ALIAS) -> None:
    """Undo :func:`bound`: the connection closes and reconnects with its own settings."""
    wrapper = _wrapper(connection)
    plain = getattr(wrapper, _PLAIN, None)
    if plain is None:
        return
    if not wrapper.in_atomic_block:
        wrapper.close()
    wrapper.settings_dict = plain
    delattr(wrapper, _PLAIN)


@contextlib.contextmanager
def bounded(
    connection: ConnectionRef = DEFAULT_DB_ALIAS, bounds: Bounds | None = None
) -> Iterator[BaseDatabaseWrapper]:
    """:func:`bound` for the duration of a block (a loop's lifetime); yields the connection."""
    wrapper = bound(connection, bounds)
    try:
        yield wrapper
    finally:
        unbound(wrapper)


def connect_params(
    connection: ConnectionRef = DEFAULT_DB_ALIAS,
    bounds: Bounds | None = None,
    *,
    application_name: str | None = None,
) -> dict[str, Any]:
    """Keywords for ``psycopg.connect()`` of a dedicated connection, with the bounds.

    For connections outside Django's (a lock session, a LISTEN connection): the alias's
    settings, less Django's own parameters, plus the bounds; statements are never prepared.
    """
    wrapper = _wrapper(connection)
    plain = getattr(wrapper, _PLAIN, None)
    if plain is not None:  # read the alias's own settings, not a bound copy of them
        saved, wrapper.settings_dict = wrapper.settings_dict, plain
        try:
            params = wrapper.get_connection_params()
        finally:
            wrapper.settings_dict = saved
    else:
        params = wrapper.get_connection_params()
    for key in DJANGO_ONLY_PARAMS:
        params.pop(key, None)
    # Never prepared, whatever the alias's OPTIONS say: behind a transaction-mode pooler a
    # statement prepared on one server connection is missing on the next.
    params["prepare_threshold"] = None
    if application_name is not None:
        params["application_name"] = application_name[:63]
    return (bounds or Bounds.from_settings()).libpq_params(params)


def abort(connection: psycopg.Connection | ConnectionRef | None) -> bool:
    """Shut a connection's socket down, from any thread; a call stuck on it raises at once.

    Nothing is sent and nothing waits, so this works on a path that has gone silent. The
    connection is broken afterwards: its owner closes it and reconnects. Returns False when
    there was no open connection to abort.
    """
    raw: psycopg.Connection[Any] | None
    if isinstance(connection, psycopg.Connection) or connection is None:
        raw = connection
    else:
        raw = _wrapper(connection).connection
    if raw is None or raw.closed:
        return False
    try:
        fd = raw.pgconn.socket
        with socket.socket(fileno=os.dup(fd)) as sock:  # shutdown acts on the shared socket
            sock.shutdown(socket.SHUT_RDWR)
    except (psycopg.Error, OSError):
        return False
    return True


class CallTimedOut(psycopg.OperationalError):
    """A call got no answer within its deadline, so its connection was aborted."""


@contextlib.contextmanager
def deadline(connection: psycopg.Connection, seconds: float) -> Iterator[None]:
    """Abort ``connection`` if the calls inside the block take longer than ``seconds``.

    A timer thread per block: for occasional calls (a leadership proof), not a hot path.
    """
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def expire() -> None:
        with lock:
            if state["done"]:
                return
            state["fired"] = True
        abort(connection)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except psycopg.Error as exc:
        if state["fired"]:
            raise CallTimedOut(
                f"no answer within {seconds:g}s; the connection was aborted"
            ) from exc
        raise
    finally:
        with lock:
            state["done"] = True
        timer.cancel()


class StallGuard:
    """Watch a loop from a thread of its own; report each time it stops moving for ``limit``.

    The loop calls :meth:`moved` as it goes (installed as a Django execute wrapper, every
    statement it starts or finishes counts), and wraps deliberate waits in :meth:`waiting`.
    Once the loop has not moved for ``limit`` seconds, ``on_stall(seconds)`` runs on the
    guard's thread, once per stall: typically it aborts the loop's connection.
    """

    def __init__(
        self,
        limit: float,
        on_stall: Callable[[float], None],
        *,
        check_every: float | None = None,
        name: str = "jobs-stall-guard",
    ) -> None:
        self.limit = limit
        self._on_stall = on_stall
        self._every = check_every if check_every is not None else min(0.25, limit / 8)
        self._moved_at = time.monotonic()
        self._waits = 0
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def moved(self) -> None:
        self._moved_at = time.monotonic()
        self._reported = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait the loop means to make: not a stall, however long."""
        self._waits += 1
        try:
            yield
        finally:
            self._waits -= 1
            self.moved()

    def __call__(
        self,
        execute: Callable[[str, Any, bool, dict[str, Any]], Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        """As ``connection.execute_wrapper(guard)``: each statement moves the loop."""
        self.moved()
        try:
            return execute(sql, params, many, context)
        finally:
            self.moved()

    def start(self) -> None:
        self.moved()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _watch(self) -> None:
        while not self._stop.wait(self._every):
            stalled = time.monotonic() - self._moved_at
            if self._waits or self._reported or stalled < self.limit:
                continue
            self._reported = True
            self._on_stall(stalled)


def _wrapper(connection: ConnectionRef) -> BaseDatabaseWrapper:
    """The calling thread's connection object for an alias or ``django.db.connection``."""
    if isinstance(connection, str):
        return connections[connection]
    if isinstance(connection, ConnectionProxy):
        return connections[connection._alias]
    return connection


def _seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _ms(value: timedelta | float) -> int:
    return math.ceil(_seconds(value) * 1000)


@contextlib.contextmanager
def local(using: str = DEFAULT_DB_ALIAS, bounds: Bounds | None = None) -> Iterator[None]:
    """A transaction whose statements have the statement and lock bounds (``SET LOCAL``).

    For the worker's own writes on a handler thread's connection, which keeps the project's
    plain settings: the bounds end with the transaction, so nothing is left on the session
    (or on a pooled server connection) for the handler's next job.
    """
    bounds = bounds or Bounds.from_settings()
    settings = [
        f"SET LOCAL {name} = {_ms(value)}"
        for name, value in (
            ("statement_timeout", bounds.statement_timeout),
            ("lock_timeout", bounds.lock_timeout),
        )
        if _ms(value)
    ]
    with transaction.atomic(using=using), connections[using].cursor() as cur:
        if settings:
            cur.execute("; ".join(settings))  # one round trip for both
        yield


def wait_for_locks(seconds: float, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Bound how long the rest of the caller's transaction waits for a lock (``SET LOCAL``).

    Ends with the transaction, so nothing is left on the session or a pooled connection.
    """
    if not connections[using].in_atomic_block:
        raise RuntimeError("wait_for_locks() applies to a transaction: call it inside one")
    with connections[using].cursor() as cur:
        cur.execute(f"SET LOCAL lock_timeout = {max(1, _ms(seconds))}")
