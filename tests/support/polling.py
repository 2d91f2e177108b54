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


def clear_of_the_next_minute(seconds: float) -> None:
    """Wait until the database clock is at least ``seconds`` before the next whole minute.

    A test that fires a minutely schedule and then reads its state through a page load is
    only right if no new minute begins in between: a slot that came due after the firing is
    rightly shown as due.
    """
    from jobs.db.clock import database_now

    def into_the_minute() -> float:
        now = database_now()
        return now.second + now.microsecond / 1e6

    wait_for(
        lambda: into_the_minute() < 60 - seconds,
        timeout=61,
        interval=0.2,
        what=f"{seconds} s before the next minute",
    )
