"""A turn for each test of a run spread over several processes (pytest-xdist), and a turn
alone for the tests that time the machine.

scripts/test runs the suite in several processes. Most tests do not mind what the others do
meanwhile, but a few assert how soon something happens or how much CPU a process got (a
handler's start latency, a rate limit's smoothness, the loop watcher telling a held GIL from a
starved process): beside two other tests that busy the CPU they fail for want of it, not for a
fault. Those run ``alone`` (conftest.py's :data:`~tests.conftest.ALONE`): while one runs, no
other test of the run does.

Every test takes a turn on two lock files in a directory the run's processes share:

- a test holds the *room* shared for as long as it runs; a test alone holds it exclusively;
- a test alone first takes the *gate*, and keeps it, so that no other test starts while it
  waits for the room to empty; every other test passes the gate (takes and lets it go) on its
  way in. Without the gate, tests that keep starting would keep the room from ever emptying.

``flock`` locks belong to an open file and go with its process, so a test process that dies
leaves no lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def turn(directory: Path, *, alone: bool) -> Iterator[None]:
    """Hold a turn to run: shared with the other tests, or ``alone``."""
    with open(directory / "tests.gate", "a") as gate, open(directory / "tests.room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(room, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
            yield
            return
        fcntl.flock(room, fcntl.LOCK_EX)  # the tests in the room finish; no new one enters
        yield
