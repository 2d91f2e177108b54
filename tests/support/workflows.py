"""Settling workflows in tests: what a commit and the release after it do, on demand."""

from __future__ import annotations

from django.db import DEFAULT_DB_ALIAS, connections

from jobs.queue import dependencies


def settle(using: str = DEFAULT_DB_ALIAS) -> int:
    """Run the checks an enqueue defers to its commit (as the commit would), then release
    the jobs waiting for ones that ended, to the end; the waiting jobs settled.

    Tests that run inside one transaction never commit, so they call this where a commit and
    the worker's release would have happened.
    """
    connection = connections[using]
    if connection.in_atomic_block:
        with connection.cursor() as cur:
            cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cur.execute("SET CONSTRAINTS ALL DEFERRED")
    settled = 0
    while (step := dependencies.release(using=using)).upstream is not None:
        settled += step.settled
    return settled
