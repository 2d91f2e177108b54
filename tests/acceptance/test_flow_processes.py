"""Flow controls held across real ``runworker`` processes: limits, a killed worker's share,
the rate, fair order and the throttle signal. Handlers record their entries and exits in
the database (``test_flow_entries``), so the peaks are counted where the limits live."""

from __future__ import annotations

import random
import statistics
import time
from datetime import datetime

import pytest
from django.db import connection

from jobs import enqueue, enqueue_many
from jobs.models import Job, Pause, TenantWeight
from tests.procapp.jobs import FlowEntry, FlowFair, FlowFairLimited, FlowRate, FlowTenant
from tests.support.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

FAST = ["--poll-interval", "0.5", "--maintenance-interval", "0.2"]


@pytest.fixture(autouse=True)
def entries():
    with connection.cursor() as cur:
        cur.execute(
            "CREATE TABLE IF NOT EXISTS test_flow_entries (id bigserial PRIMARY KEY, "
            "job_id text, type text, tenant text, pid int, entered timestamptz, "
            "left_at timestamptz)"
        )
        cur.execute("TRUNCATE test_flow_entries")
    yield
    with connection.cursor() as cur:
        cur.execute("DROP TABLE test_flow_entries")


def peak(
    type_name: str,
    *,
    by_tenant: bool = False,
    dead_pid: int | None = None,
    killed_at: datetime | None = None,
) -> int:
    """The most handlers of a type (of one tenant) inside at once. A killed process's
    handlers stopped when it died (``killed_at``): their open entries end at the kill."""
    partition = "PARTITION BY tenant" if by_tenant else ""
    with connection.cursor() as cur:
        cur.execute(
            f"""
            WITH spans AS (
                SELECT tenant, entered,
                       COALESCE(left_at, CASE WHEN pid = %(dead)s THEN %(killed)s::timestamptz END,
                                'infinity') AS left_at
                FROM test_flow_entries WHERE type = %(type)s
            ),
            edges AS (
                SELECT tenant, entered AS at, 1 AS step FROM spans
                UNION ALL SELECT tenant, left_at, -1 FROM spans
            )
            SELECT COALESCE(max(inside), 0) FROM (
                SELECT sum(step) OVER ({partition} ORDER BY at, step) AS inside FROM edges
            ) s
            """,
            {"type": type_name, "dead": dead_pid or -1, "killed": killed_at},
        )
        return cur.fetchone()[0]


def states(name: str) -> dict[str, int]:
    rows = Job.objects.filter(name=name).values_list("state", flat=True)
    counts: dict[str, int] = {}
    for state in rows:
        counts[state] = counts.get(state, 0) + 1
    return counts


def test_a_global_limit_holds_across_workers_and_a_killed_workers_share_comes_back(spawn):
    workers = [spawn("runworker", *FAST, "--concurrency", "20", lease=1.0) for _ in range(3)]
    for worker in workers:
        worker.wait_for_output("worker .* started")
    enqueue_many([FlowEntry(seconds=0.1) for _ in range(60)])
    # Kill a worker while it runs jobs of the type (whichever won a place first: with three
    # places for three workers, no given one is sure to): its places stay taken until its
    # leases expire and a sweep puts the jobs back.
    by_pid = {worker.pid: worker for worker in workers}

    def running_worker() -> object | None:
        for claimed_by in Job.objects.filter(state="running").values_list("claimed_by", flat=True):
            for pid, worker in by_pid.items():
                if f":{pid}:" in claimed_by:
                    return worker
        return None

    victim = wait_for(running_worker, timeout=20, what="a worker runs a job")
    victim.proc.kill()
    victim.wait()
    with connection.cursor() as cur:
        cur.execute("SELECT clock_timestamp()")
        killed_at = cur.fetchone()[0]

    wait_for(lambda: states(FlowEntry.job_name) == {"succeeded": 60}, timeout=60)
    assert peak(FlowEntry.job_name, dead_pid=victim.pid, killed_at=killed_at) <= 3
    assert peak(FlowEntry.job_name, dead_pid=victim.pid, killed_at=killed_at) == 3  # reached


def test_a_tenant_limit_holds_per_tenant_while_tenants_run_side_by_side(spawn):
    for _ in range(2):
        spawn("runworker", *FAST, "--concurrency", "20").wait_for_output("worker .* started")
    for tenant in ("a", "b", "c"):
        enqueue_many([FlowTenant(seconds=0.1) for _ in range(12)], tenant=tenant)

    wait_for(lambda: states(FlowTenant.job_name) == {"succeeded": 36}, timeout=60)
    assert peak(FlowTenant.job_name, by_tenant=True) == 2
    assert peak(FlowTenant.job_name) >= 4  # tenants were not serialized behind each other


def test_a_rate_limit_is_shared_by_the_workers_and_smooth(spawn):
    for _ in range(2):
        spawn("runworker", *FAST, "--concurrency", "10").wait_for_output("worker .* started")
    enqueue_many([FlowRate(seconds=0) for _ in range(100)])

    wait_for(lambda: states(FlowRate.job_name) == {"succeeded": 100}, timeout=60)
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM entered - min(entered) OVER ())::float8 "
            "FROM test_flow_entries ORDER BY entered"
        )
        starts = [row[0] for row in cur.fetchall()]
    # 20 a second with a burst of 2: the first two at once, then one every 50 ms.
    rate = (len(starts) - 2) / (starts[-1] - starts[1])
    assert 18 <= rate <= 21, rate
    assert max(sum(1 for s in starts if t <= s < t + 1) for t in starts) <= 22


def test_fair_order_serves_a_small_tenant_beside_a_flood(spawn):
    for _ in range(2):
        spawn("runworker", *FAST, "--concurrency", "4").wait_for_output("worker .* started")
    enqueue_many([FlowFair(seconds=0.01) for _ in range(1500)], tenant="flood")
    wait_for(lambda: states(FlowFair.job_name).get("succeeded", 0) >= 50, timeout=30)
    small = [enqueue(FlowFair(seconds=0.01), tenant="small").id for _ in range(20)]

    wait_for(lambda: Job.objects.filter(pk__in=small, state="succeeded").count() == 20, timeout=30)
    # The small tenant's jobs waited about their share, not for the flood to drain.
    assert Job.objects.filter(name=FlowFair.job_name, state="queued").count() > 500
    waits = [
        (job.started_at - job.run_after).total_seconds() for job in Job.objects.filter(pk__in=small)
    ]
    assert statistics.median(waits) < 1.0, waits


@pytest.mark.parametrize("kind", [FlowFair, FlowFairLimited], ids=["fair", "with a global limit"])
def test_tenant_weights_hold_across_workers_over_time(spawn, kind):
    """Three tenants weighted 1/1/3 flood a fair type on 3 workers of 20 threads: over the
    first 1,500 starts (every tenant has due jobs throughout), the starts follow the weights
    within 5 %."""
    TenantWeight.objects.bulk_create([TenantWeight(tenant="c", weight=3)])
    # Jobs of uneven lengths end at their own times: the workers' passes claim a few at once.
    lengths = random.Random(5)
    for tenant in ("a", "b", "c"):
        enqueue_many(
            [kind(seconds=lengths.uniform(0.005, 0.08)) for _ in range(1000)], tenant=tenant
        )
    for _ in range(3):
        spawn("runworker", *FAST, "--concurrency", "20").wait_for_output("worker .* started")

    def started() -> int:
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM test_flow_entries")
            return cur.fetchone()[0]

    wait_for(lambda: started() >= 1500, timeout=60, what="1,500 starts")
    with connection.cursor() as cur:
        cur.execute(
            "SELECT tenant, count(*) FROM (SELECT tenant FROM test_flow_entries "
            "ORDER BY entered LIMIT 1500) s GROUP BY tenant"
        )
        starts = dict(cur.fetchall())
    expected = {"a": 300, "b": 300, "c": 900}
    assert all(abs(starts[t] - n) <= 0.05 * n for t, n in expected.items()), starts


def test_a_throttle_pauses_the_type_on_every_worker_for_its_delay(spawn):
    for _ in range(2):
        spawn("runworker", *FAST, "--concurrency", "4").wait_for_output("worker .* started")
    first = enqueue(FlowEntry(seconds=0, throttle_first=2.0))
    pause = wait_for(
        lambda: Pause.objects.filter(kind="job_type", value=FlowEntry.job_name).first(),
        timeout=20,
        what="the throttle's pause",
    )
    assert pause.until is not None and pause.paused_by == "throttle"
    others = [enqueue(FlowEntry(seconds=0)).id for _ in range(5)]
    asked = time.monotonic()

    wait_for(lambda: states(FlowEntry.job_name) == {"succeeded": 6}, timeout=30)
    # Nothing of the type started before the throttle ended.
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM test_flow_entries WHERE job_id <> %s AND entered < %s",
            [first.job_id, pause.until],
        )
        assert cur.fetchone()[0] == 0
    assert time.monotonic() - asked < 10
    assert len(others) == 5
