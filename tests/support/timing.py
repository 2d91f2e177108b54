"""Timing tests' one measurement: two ways of doing the same thing, timed in turns."""

from __future__ import annotations

import timeit
from collections.abc import Callable


def cost_ratio(
    way: Callable[[], object], other: Callable[[], object], number: int = 2_000
) -> float:
    """The best time of ``way`` over the best time of ``other``, each ``number`` calls a round,
    in 15 alternating rounds: a burst of other work on a shared machine then slows rounds of
    both, not only the rounds of one (as timing all of one, then all of the other, let it)."""
    best_way = best_other = float("inf")
    for _ in range(15):
        best_way = min(best_way, timeit.timeit(way, number=number))
        best_other = min(best_other, timeit.timeit(other, number=number))
    return best_way / best_other
