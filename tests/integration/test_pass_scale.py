"""A worker's pass costs about the same a job whatever its size.

A worker with many slots writes and claims hundreds of jobs in one pass. The pass's plan is
made once a connection, from the table's statistics at the time: made when few rows were
running, it joined the outcomes to the rows they hold by comparing every one with every
other, so a pass of 1,000 cost PostgreSQL 150 µs of CPU a job instead of 23.
"""

from __future__ import annotations

import importlib
import time

import pytest
from django.core.management import call_command
from django.db import connection

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome

NAME = "test.pass.scale.v1"
SIZE = 1_500  # the large pass
SMALL = 100  # the same jobs in passes of this size
BACKLOG = 30_000  # queued: the table's size moves the plan's costs

pytestmark = pytest.mark.django_db(transaction=True)


def held_jobs(count: int) -> list:
    """``count`` running jobs, with statistics taken while none was running and the pass's
    plan made afresh from them (a new connection)."""
    queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(BACKLOG)])
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")
    connection.close()
    return queue.claim([ClaimRequest(NAME, count)], scope=AllTenants(), limit=count, worker="w")


def passes(jobs: list, size: int) -> float:
    """Seconds to write ``jobs``' outcomes and claim as many, in passes of ``size``."""
    started = time.perf_counter()
    for at in range(0, len(jobs), size):
        done = jobs[at : at + size]
        report, claimed = queue.record_and_claim(
            [Outcome.succeeded(job, None) for job in done],
            [ClaimRequest(NAME, len(done))],
            scope=AllTenants(),
            worker="w",
            count=False,
        )
        assert len(report.applied) == len(done) and len(claimed) == len(done)
    return time.perf_counter() - started


@pytest.mark.slow
def test_one_large_pass_costs_no_more_than_small_passes_of_the_same_jobs():
    best = {SIZE: float("inf"), SMALL: float("inf")}
    for _round in range(2):  # in turns, so a burst of load slows both
        for size in best:
            with connection.cursor() as cur:
                cur.execute("TRUNCATE jobs_job")
            best[size] = min(best[size], passes(held_jobs(SIZE), size))
    # One statement for 1,500 jobs instead of 15: it should cost less, not several times more.
    assert best[SIZE] < 1.5 * best[SMALL], best


def functions() -> dict[str, str]:
    """The bodies of the passes the database runs."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT proname, prosrc FROM pg_proc "
            "WHERE proname IN ('jobs_worker_pass', 'jobs_worker_fair_pass')"
        )
        return dict(cur.fetchall())


def bodies(plain: str, fair: str) -> dict[str, str]:
    """The bodies the migrations ``plain`` and ``fair`` create."""
    return {
        name: importlib.import_module(f"jobs.migrations.{module}").SQL.split("$$")[1]
        for name, module in (("jobs_worker_pass", plain), ("jobs_worker_fair_pass", fair))
    }


def test_the_migrations_put_the_passes_back_both_ways():
    now = bodies("0022_worker_pass_linear", "0023_worker_fair_pass_linear")
    before = bodies(
        "0019_worker_pass_busy_when_unwritten", "0020_worker_fair_pass_busy_when_unwritten"
    )
    assert functions() == now
    try:
        call_command("migrate", "jobs", "0021", verbosity=0)
        assert functions() == before
    finally:
        call_command("migrate", "jobs", verbosity=0)
    assert functions() == now
