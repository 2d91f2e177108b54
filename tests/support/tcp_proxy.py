"""A TCP proxy to the test PostgreSQL that can go silent: the network path of a partition.

``freeze()`` stops forwarding bytes in both directions but closes nothing, so the client's
kernel still acknowledges what it sends (the proxy's socket is alive) and keepalive probes
are answered: a call on a connection through it simply never gets its answer. That is the
failure TCP's own timeouts cannot see (a hung pooler or proxy, a half-dead NAT), and the one
the client-side bounds of ``jobs.db.bounds`` exist for.

``down()`` plays a restart instead: every connection is cut, and each new one is answered as
PostgreSQL answers while it starts up (``FATAL: the database system is starting up``) until
``up()``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
from urllib.parse import quote

from django.db import connection


def database_target() -> str | tuple[str, int]:
    """Where the test database listens: a Unix socket path, or (host, port)."""
    params = connection.settings_dict
    host = params["HOST"] or "localhost"
    port = int(params.get("PORT") or 5432)
    if host.startswith("/"):
        return os.path.join(host, f".s.PGSQL.{port}")
    return (host, port)


class TcpProxy:
    """Forward TCP connections on ``host`` (any free port) to ``target``."""

    def __init__(
        self, target: str | tuple[str, int] | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.target = target or database_target()
        self.host = host  # another namespace's way in: the address of a veth's near end
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = threading.Event()
        self._starting_up = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    def database_url(self) -> str:
        """The test database's URL, reached through this proxy."""
        params = connection.settings_dict
        password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
        return (
            f"postgres://{quote(params['USER'])}{password}@{self.host}:{self.port}/{params['NAME']}"
        )

    def freeze(self) -> None:
        """Stop forwarding, keep every socket open: calls through the proxy hang."""
        self._forwarding.clear()

    def thaw(self) -> None:
        self._forwarding.set()

    def down(self) -> None:
        """Cut every connection; answer new ones as a server starting up, until :meth:`up`."""
        self._starting_up.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        self._drop(*sockets)

    def up(self) -> None:
        self._starting_up.clear()

    def close(self) -> None:
        self._closed.set()
        self._forwarding.set()  # wake the pumps so they see the close
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._starting_up.is_set():
                threading.Thread(target=_starting_up, args=(client,), daemon=True).start()
                continue
            family = socket.AF_UNIX if isinstance(self.target, str) else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            try:
                upstream.connect(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            for sock in peers:
                selector.register(sock, selectors.EVENT_READ)
            while not self._closed.is_set():
                if not self._forwarding.is_set():
                    self._forwarding.wait()  # silent: read nothing, send nothing, close nothing
                    continue
                for key, _ in selector.select(timeout=0.1):
                    if not self._forwarding.is_set():
                        break
                    try:
                        data = key.fileobj.recv(65536)
                        if not data:
                            return self._drop(client, upstream)
                        peers[key.fileobj].sendall(data)
                    except OSError:
                        return self._drop(client, upstream)

    def _drop(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


# The start-up request codes of an SSLRequest and a GSSENCRequest, which a server may decline.
_ENCRYPTION_REQUESTS = (80877103, 80877104)
_STARTING_UP = b"SFATAL\0VFATAL\0C57P03\0Mthe database system is starting up\0\0"


def _starting_up(client: socket.socket) -> None:
    """Answer a client's start-up as PostgreSQL does before it accepts connections."""
    with contextlib.suppress(OSError), client:
        while True:
            (length,) = struct.unpack("!i", _read(client, 4))
            (code,) = struct.unpack("!i", _read(client, length - 4)[:4])
            if code not in _ENCRYPTION_REQUESTS:
                break
            client.sendall(b"N")  # no encryption: the start-up message comes next
        client.sendall(b"E" + struct.pack("!i", len(_STARTING_UP) + 4) + _STARTING_UP)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed")
        data += chunk
    return data
