"""Shared fixtures. Every test that touches the database runs on real PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection


def run_in_threads(count: int, target: Callable[[int], Any], timeout: float = 30) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads released together; return results in order.

    Each thread uses its own database connection (Django connections are per thread) and
    closes it when done. An exception in any thread is re-raised here.
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait(timeout)
            results[index] = target(index)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a test thread did not finish in time"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def threads():
    return run_in_threads
