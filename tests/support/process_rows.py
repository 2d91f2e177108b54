"""Rows of the process table (``jobs_process``) in any age, for the registry's tests."""

from __future__ import annotations

from django.db import connection

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob, processes
from tests.support.worker import Echo


def register(identity: str = "h:1:aa", *, expires_in: float = 10.0, **kwargs) -> None:
    kwargs = {"component": "worker", "host": "h", "pid": 1, "version": "0.1.0", **kwargs}
    kwargs.setdefault("concurrency", 4 if kwargs["component"] == "worker" else None)
    processes.register(identity, expires_in=expires_in, **kwargs)


def shift(identity: str, **deltas: float) -> None:
    """Move a row's timestamps back by seconds (PostgreSQL's clock), to age it without waiting."""
    sets = ", ".join(f"{column} = {column} - make_interval(secs => %s)" for column in deltas)
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE jobs_process SET {sets} WHERE identity = %s", [*deltas.values(), identity]
        )


def claim_for(identity: str, count: int = 1) -> list[queue.ClaimedJob]:
    for i in range(count):
        queue.enqueue(NewJob(Echo.job_name, {"text": str(i)}))
    return queue.claim([ClaimRequest(Echo.job_name, count)], scope=AllTenants(), worker=identity)
