"""Batches of blocking and quick tasks for the handler pool's hand-off tests."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from hypothesis import strategies as st

from jobs.worker.pool import HandlerPool
from tests.support.polling import wait_for


def run_batches(
    pool: HandlerPool,
    batches: list[tuple[list[bool], int]],
    pauses: Sequence[float] = (),
) -> None:
    """Submit each batch (True: a task that blocks until released) waking ``wake`` threads,
    after its pause if given (the gap between passes); every quick task must finish while
    the blocking ones still hold their threads."""
    release = threading.Event()
    done: list[int] = []
    lock = threading.Lock()

    def task(number: int, blocks: bool):
        def run() -> None:
            if blocks:
                release.wait(30)
            with lock:
                done.append(number)

        return run

    quick = 0
    number = 0
    for (kinds, wake), pause in itertools.zip_longest(batches, pauses[: len(batches)]):
        if pause:
            time.sleep(pause)  # the gap between passes: not a wait for anything
        tasks = []
        for blocks in kinds:
            tasks.append(task(number, blocks))
            quick += not blocks
            number += 1
        pool.submit_many(tasks, wake=wake)
    try:
        wait_for(lambda: len(done) == quick, what=f"{quick} quick tasks done", timeout=20)
        assert not release.is_set()
    finally:
        release.set()
    wait_for(lambda: len(done) == number, what="every task done", timeout=20)


def draw_batches(
    data: st.DataObject, size: int, count: st.SearchStrategy[int], *, max_tasks: int
) -> list[tuple[list[bool], int]]:
    """Batches for a pool of ``size`` threads: each a mix of blocking (True) and quick tasks,
    fewer blocking in all than threads, and a number of threads to wake for it."""
    blocking_left = size - 1
    batches = []
    for _ in range(data.draw(count, label="batches")):
        kinds = data.draw(st.lists(st.booleans(), min_size=1, max_size=max_tasks), label="tasks")
        kept = []
        for blocks in kinds:
            blocks = blocks and blocking_left > 0
            blocking_left -= blocks
            kept.append(blocks)
        batches.append((kept, data.draw(st.integers(1, len(kept)), label="wake")))
    return batches
