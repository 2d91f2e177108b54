"""The private HTTP listener of worker and scheduler processes: health, readiness, metrics.

Off unless a port is given. Bind it to a private interface: it has no authentication.

* ``/healthz`` — 200 while the process's main loop is making progress (liveness).
* ``/readyz``  — 200 while the process does its work (a worker claiming, a scheduler leading
  or standing by), 503 while starting or draining.
* ``/metrics`` — Prometheus text format.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

logger = logging.getLogger("jobs.http")


def start_http_server(
    host: str,
    port: int,
    *,
    healthy: Callable[[], bool],
    ready: Callable[[], bool],
) -> ThreadingHTTPServer:
    """Serve the three endpoints from a daemon thread; ``server.server_port`` is the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(*_status(healthy(), "ok", "stalled"))
            elif path == "/readyz":
                self._reply(*_status(ready(), "ready", "not ready"))
            elif path == "/metrics":
                self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b"not found\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("%s " + format, self.client_address[0], *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="jobs-http", daemon=True)
    thread.start()
    logger.info("serving /healthz, /readyz and /metrics on %s:%s", host, server.server_port)
    return server


def _status(ok: bool, yes: str, no: str) -> tuple[int, bytes]:
    return (200, f"{yes}\n".encode()) if ok else (503, f"{no}\n".encode())
