"""Waiting in tests: poll a condition until a deadline, never sleep for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for[T](
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy, and
    return that; fail the test if it has not within ``timeout`` seconds.

    The timeout is the bound a test states ("within a lease", "within a second"), so tests
    that assert a time pass it explicitly. The interval sets how soon a change is seen: a
    test that must act within a moment of a change (a poll that has just begun) passes a
    shorter one.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s")
