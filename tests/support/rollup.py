"""Outcomes and rollup rows for the console's charts: jobs ended through the queue, and
minute or hour rows in the past as the outcome writes and compaction leave them."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from django.db import connection

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, Outcome, rollup
from tests.support.factories import JobFactory


def end(outcomes: list[tuple[str, str, str]]) -> None:
    """Enqueue, claim and end one job per ``(name, outcome, code)`` through the queue."""
    for name, _outcome, _code in outcomes:
        JobFactory(name=name)
    claimed: dict[str, list[Any]] = defaultdict(list)
    for name in {name for name, _o, _c in outcomes}:
        count = sum(1 for n, _o, _c in outcomes if n == name)
        claimed[name] = queue.claim([ClaimRequest(name, count)], scope=AllTenants())
    written = []
    for name, outcome, code in outcomes:
        job = claimed[name].pop()
        if outcome == "succeeded":
            written.append(Outcome.succeeded(job))
        elif outcome == "failed":
            written.append(Outcome.failed(job, code=code))
        elif outcome == "retried":
            written.append(Outcome.retry(job, code=code, delay=3600))
        else:
            raise AssertionError(outcome)
    assert len(queue.record(written).applied) == len(outcomes)


def put_history(
    name: str,
    outcome: str,
    code: str,
    count: int,
    *,
    hours_ago: int = 0,
    minutes_ago: int = 0,
    runs: tuple[float, ...] = (),
    waits: tuple[float, ...] = (),
    now: datetime | None = None,
) -> None:
    """A rollup row in the past, as the outcome writes (minutes) or compaction (hours) leave
    them: an hour row ``hours_ago`` back, or a minute row ``minutes_ago`` back, from ``now``
    (default: the database's)."""
    width, unit, arg, back = (
        (3600, "hour", "hours", hours_ago) if hours_ago else (60, "minute", "mins", minutes_ago)
    )
    run, wait = rollup.Distribution.of(runs), rollup.Distribution.of(waits)
    with connection.cursor() as cur:
        cur.execute(
            f"""
            INSERT INTO jobs_rollup (period, width, name, outcome, code, shard, count,
                                     run_seconds, wait_seconds, run_histogram, wait_histogram)
            VALUES (date_trunc('{unit}', now()) - make_interval({arg} => %s::int), {width},
                    %s, %s, %s, 0, %s, %s, %s, %s, %s)
            """,
            [
                back,
                name,
                outcome,
                code,
                count,
                sum(runs),
                sum(waits),
                list(run.counts),
                list(wait.counts),
            ],
        )
