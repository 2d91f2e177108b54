"""Jobs of the factory's no-op type (``test.noop.v1``), enqueued and claimed through the queue."""

from __future__ import annotations

from typing import Any

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob

NAME = "test.noop.v1"

SCOPE = AllTenants()


def enqueue(count: int, **options: Any) -> list[int]:
    jobs = [NewJob(name=NAME, payload={}, **options)] * count
    return [e.id for e in queue.enqueue_many(jobs)]


def claim(limit: int, scope=SCOPE) -> list:
    return queue.claim([ClaimRequest(NAME, limit)], scope=scope, worker="w")
