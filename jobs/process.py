"""Plumbing shared by the long-running commands (worker, scheduler): signals and HTTP."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any


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
    from jobs.http import start_http_server

    return start_http_server(host, port, healthy=healthy, ready=ready)
