"""A process that runs the worker's handler loop and its watcher, for tests that stop it.

``python -m tests.support.loop_watch BLOCKED_AFTER`` logs what the watcher says to stderr, prints
``ready`` once the loop runs, then reads commands on stdin: ``gil SECONDS`` holds the GIL for
that long (in C code that never lets it go, burning CPU), as a CPU-bound handler thread
stuck in one long call does. The tests stop it with SIGSTOP, which no command can do.
"""

from __future__ import annotations

import collections
import itertools
import logging
import sys
import time

from jobs.worker.event_loop import HandlerLoop


def hold_gil(seconds: float) -> None:
    """Spin in C until ``seconds`` have passed: no bytecode runs, so the GIL is never let go."""
    deadline = time.monotonic() + seconds
    now = itertools.starmap(time.monotonic, itertools.repeat(()))
    collections.deque(itertools.takewhile(deadline.__gt__, now), maxlen=0)


def main(blocked_after: float) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    loop = HandlerLoop("watched-loop", blocked_after=blocked_after)
    loop.start()
    print("ready", flush=True)
    for line in sys.stdin:
        command, _, argument = line.partition(" ")
        if command == "gil":
            hold_gil(float(argument))
            print("released", flush=True)
    loop.close(2)


if __name__ == "__main__":
    main(float(sys.argv[1]))
