"""Worker "hosts" for tests: each in network and UTS namespaces of its own, linked by a veth.

::

    this namespace: PostgreSQL, the test           a host's namespaces (hostname host-a)
    ┌────────────────────────────────────┐  veth  ┌───────────────────────────────────┐
    │ a TCP forwarder on <near>:port ────┼────────┼── manage.py runworker, connecting │
    │   to PostgreSQL's Unix socket      │        │   to <near>:port as a remote host │
    └────────────────────────────────────┘        └───────────────────────────────────┘

:meth:`Host.cut` sets the near end of the link down: the far end loses its carrier and every
packet either way is dropped, while both sides keep their addresses and sockets. Nothing tells
the host the path is gone, so its open connections hang (as when a switch or a cable dies)
rather than fail; :meth:`Host.restore` brings the link back. Needs root and iproute2's ``ip``;
:func:`unavailable` says why a test cannot have hosts here.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import shutil
import subprocess

from tests.support.processes import alive

PREFIX = "jobs-test-"  # namespaces are named PREFIX<pid of the test run>-<host>


def unavailable() -> str | None:
    """Why this machine cannot give a test its hosts, or None when it can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"no {tool} command (Debian package {package}; scripts/test installs iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def remove_orphans() -> None:
    """Delete the namespaces (and so their links) of test runs that were killed."""
    listing = _ip("netns", "list", check=False).stdout
    for namespace, pid in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\S+)", listing, re.M):
        if not alive(int(pid)):
            _ip("netns", "delete", namespace, check=False)


class Host:
    """One host: a network and a UTS namespace, and a veth link to this namespace."""

    def __init__(self, name: str, index: int) -> None:
        pid = os.getpid()
        self.name = name  # its hostname
        self.namespace = f"{PREFIX}{pid}-{name}"
        self.link = f"jt{pid}-{index}"  # the near end (at most 15 characters)
        self.near, self.far = _addresses(index)
        self.created = False

    def create(self) -> Host:
        """Make the namespace and the link, with ``near`` here and ``far`` in the namespace."""
        _ip("netns", "add", self.namespace)
        self.created = True
        inside = ("-n", self.namespace)
        _ip(
            *("link", "add", self.link, "address", _mac(self.near), "type", "veth"),
            *("peer", "name", "eth0", "address", _mac(self.far), "netns", self.namespace),
        )
        _ip("addr", "add", f"{self.near}/30", "dev", self.link)
        _ip(*inside, "addr", "add", f"{self.far}/30", "dev", "eth0")
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", "eth0", "up")
        # Fixed neighbours: with the link cut, a new connection's SYN is dropped (it hangs)
        # instead of failing fast when ARP gets no answer.
        _ip(
            *inside,
            "neigh",
            "replace",
            self.near,
            "lladdr",
            _mac(self.near),
            "dev",
            "eth0",
            "nud",
            "permanent",
        )
        self.restore()
        return self

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the host, under its own hostname (it is ``exec``'d: same pid)."""
        return [
            *("ip", "netns", "exec", self.namespace),
            *("unshare", "--uts", "--"),
            *("sh", "-c", 'hostname "$0" && exec "$@"', self.name),
            *argv,
        ]

    def cut(self) -> None:
        """Drop every packet to and from the host: its connections hang, none is closed."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")
        # (Setting the link down flushed this side's neighbours, fixed ones too.)
        _ip(
            "neigh",
            "replace",
            self.far,
            "lladdr",
            _mac(self.far),
            "dev",
            self.link,
            "nud",
            "permanent",
        )

    def destroy(self) -> None:
        """Delete the namespace; the link's two ends go with it."""
        if self.created:
            _ip("netns", "delete", self.namespace, check=False)
            self.created = False

    def __enter__(self) -> Host:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _addresses(index: int) -> tuple[str, str]:
    """The near and far addresses of host ``index``: a /30 of this run's network."""
    base = int(_network().network_address) + 4 * index
    return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))


@functools.cache
def _network() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 for this run's hosts that no interface here uses yet."""
    used = [
        ipaddress.ip_address(address)
        for address in re.findall(r"inet (\S+)/", _ip("-4", "-o", "addr", "show").stdout)
    ]
    pid = os.getpid()
    for attempt in range(64):
        net = ipaddress.ip_network(f"10.{200 + (pid + attempt) % 50}.{(pid // 50) % 256}.0/24")
        if not any(address in net for address in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 network for the test hosts")


def _mac(address: str) -> str:
    """A locally administered MAC address made of an IPv4 address."""
    return "02:6a:" + ":".join(f"{octet:02x}" for octet in ipaddress.ip_address(address).packed)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done
