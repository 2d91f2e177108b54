"""The watcher of the handlers' event loop, in a real process: what held the loop up.

A loop that has not run for a while was held by code on it (a ``time.sleep`` inside ``async
def``: tests/integration/worker/test_async_handlers.py), by another thread that kept the GIL, or
by nothing in the worker at all: the whole process was stopped (SIGSTOP, a paused host or VM)
and no thread of it ran. The watcher names which, so that a paused host is not chased as a
CPU-bound handler. The process is tests/support/loop_watch.py: the loop and its watcher, nothing
else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.polling import wait_for
from tests.support.processes import ROOT

pytestmark = [pytest.mark.acceptance, pytest.mark.once]

BLOCKED_AFTER = 0.4
#: How long the process is held up: well past BLOCKED_AFTER and the watcher's beat.
HELD = 1.2


class Watched:
    def __init__(self, proc: subprocess.Popen[str], output: Callable[[], str]) -> None:
        self.proc = proc
        self.output = output

    def warnings(self) -> list[str]:
        return [line for line in self.output().splitlines() if "has not run for" in line]

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()


@pytest.fixture
def watched(tmp_path) -> Iterator[Watched]:
    log = tmp_path / "loop_watch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.loop_watch", str(BLOCKED_AFTER)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    process = Watched(proc, log.read_text)
    try:
        wait_for(lambda: "ready" in process.output(), what="the loop started", timeout=20)
        yield process
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        print(process.output())


def test_a_stopped_process_is_not_blamed_on_the_gil(watched):
    """SIGSTOP then SIGCONT: every thread was held, and none of the worker's code did it."""
    os.kill(watched.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(HELD)  # how long it is stopped is the scenario, not a wait for something
    finally:
        os.kill(watched.proc.pid, signal.SIGCONT)
    [warning] = wait_for(watched.warnings, timeout=5, what="the watcher's warning")
    assert "the whole process was stopped" in warning
    assert "GIL" not in warning and "blocks" not in warning


def test_a_thread_that_holds_the_gil_is_named(watched):
    """Another thread keeps the GIL (here for one long call in C code): the loop waits for it."""
    watched.send(f"gil {HELD}")
    wait_for(lambda: "released" in watched.output(), timeout=10, what="the GIL let go")
    [warning] = wait_for(watched.warnings, timeout=5, what="the watcher's warning")
    assert "it waits for the GIL" in warning
    assert "stopped" not in warning
