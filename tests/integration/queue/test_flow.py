"""Flow controls in the claim: global and tenant limits, rate buckets, tenant order.

Tenants that can take nothing (only delayed jobs, out of scope, paused, past the attempt
cap) take no place in a claim; every queued row of a tenant-ordered type is in the tenant
index, across a deploy that turns the order on or off; the tenant cursor wraps; the gate
holds exact limits and buckets under concurrent claimers, also for a claim in an open
transaction; a worker makes a missing gate row again and holds a full type back.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import Policy, Rate, queue
from jobs import enqueue as enqueue_job
from jobs.catalogue.registry import JobType, Registry
from jobs.db.clock import database_now
from jobs.models import FlowGate, Job, TenantBucket, TenantWeight
from jobs.queue import (
    AllTenants,
    AllTenantsExcept,
    ClaimRequest,
    NewJob,
    OnlyTenant,
    Outcome,
    flow,
)
from jobs.queue.flow import FlowLimits, limits_of
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.support.enqueue import inserted_row_by_row
from tests.support.explain import explained_claim
from tests.support.factories import TenantOverrideFactory
from tests.support.polling import wait_for
from tests.support.worker import Echo, Recorder, Step, echo_handler, scripted

enqueue_module = importlib.import_module("jobs.queue.enqueue")

pytestmark = pytest.mark.django_db

NAME = "test.flow.v1"


def enqueue(tenant: str, count: int, name: str = NAME) -> None:
    queue.enqueue_many([NewJob(name, {}, tenant=tenant) for _ in range(count)])


def take(
    limits: FlowLimits,
    asked: int = 50,
    *,
    scope=None,
    after: dict | None = None,
    cap: int | None = None,
    name: str = NAME,
):
    return queue.claim(
        [ClaimRequest(name, asked, cap)],
        scope=scope or AllTenants(),
        limits={name: limits},
        after=after,
    )


def test_global_limit_counts_running_jobs():
    limits = FlowLimits(global_concurrency=3)
    flow.ensure({NAME: limits})
    enqueue("a", 10)

    first = take(limits)
    assert len(first) == 3
    assert take(limits) == []
    queue.complete(first[0])
    assert len(take(limits)) == 1


def test_fair_claim_shares_between_tenants():
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    enqueue("a", 100)
    enqueue("b", 5)
    assert Job.objects.filter(fair=True).count() == 105

    claimed = take(limits, asked=20)
    tenants = [job.tenant for job in claimed]
    assert len(claimed) == 20
    assert tenants.count("b") == 5


def test_rate_bucket_takes_tokens():
    limits = FlowLimits(rate=1.0, burst=2.0)
    flow.ensure({NAME: limits})
    enqueue("a", 10)
    assert len(take(limits)) == 2
    assert take(limits) == []
    gate = FlowGate.objects.get(name=NAME)
    assert gate.version == 1 and gate.tokens < 1


def test_tenant_limit():
    limits = FlowLimits(tenant_concurrency=2)
    flow.ensure({NAME: limits})
    enqueue("a", 10)
    enqueue("b", 10)
    claimed = take(limits)
    assert sorted(job.tenant for job in claimed) == ["a", "a", "b", "b"]


# -- any backlog: limits hold, shares are fair, nothing due is left while there is room ----

backlogs = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "e"]),
    st.tuples(st.integers(0, 12), st.integers(0, 3)),  # (due jobs, of them running already)
    min_size=1,
)


@example(
    backlog={"a": (12, 0), "b": (12, 0), "c": (1, 0)}, asked=15, tcap=None, gcap=None, after=""
)
@example(backlog={"a": (1, 0), "b": (5, 0), "c": (5, 0)}, asked=11, tcap=None, gcap=None, after="")
@given(
    backlog=backlogs,
    asked=st.integers(1, 15),
    tcap=st.sampled_from([None, 1, 2, 4]),
    gcap=st.sampled_from([None, 3, 8, 30]),
    after=st.sampled_from(["", "b", "c", "z"]),
)
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_tenant_backlog_is_claimed_within_limits_and_in_fair_shares(
    claim_form, backlog, asked, tcap, gcap, after
):
    limits = FlowLimits(fair=True, tenant_concurrency=tcap, global_concurrency=gcap)
    with transaction.atomic():
        flow.ensure({NAME: limits})
        running: dict[str, int] = {}
        for tenant, (due, busy) in backlog.items():
            enqueue(tenant, due + busy)
            if busy:  # some of each tenant's jobs are running already (another worker's)
                held = queue.claim(
                    [ClaimRequest(NAME, busy)], scope=OnlyTenant(tenant), worker="other"
                )
                running[tenant] = len(held)

        claimed = take(limits, asked=asked, after={NAME: after})

        got = Counter(job.tenant for job in claimed)
        total_running = sum(running.values())
        # Never past a limit.
        if gcap is not None:
            assert total_running + len(claimed) <= max(gcap, total_running)
        for tenant, count in got.items():
            if tcap is not None:
                assert running.get(tenant, 0) + count <= max(tcap, running.get(tenant, 0))
        # What each tenant could take: its due jobs, within its tenant limit.
        room = {
            tenant: min(due, due if tcap is None else max(0, tcap - running.get(tenant, 0)))
            for tenant, (due, _) in backlog.items()
        }
        budget = asked if gcap is None else max(0, min(asked, gcap - total_running))
        assert len(claimed) <= budget
        # Work-conserving: a claim short of its budget took every job it could.
        if len(claimed) < budget:
            assert all(got[t] == room[t] for t in room)
        # Max-min fair: tenants that wanted more than they got differ by at most one job, and
        # none got more than a tenant that wanted more.
        wanting = [got[t] for t in room if room[t] > got[t]]
        if wanting:
            assert max(wanting) - min(wanting) <= 1
            assert max(got.values(), default=0) <= max(wanting) + 1
        assert {job.tenant for job in claimed} <= {t for t in room if room[t] > 0}
        transaction.set_rollback(True)


def test_weights_share_a_claim_in_proportion():
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    TenantWeight.objects.create(tenant="big", weight=3)
    enqueue("big", 50)
    enqueue("small", 50)

    got = Counter(job.tenant for job in take(limits, asked=20))

    assert got == {"big": 15, "small": 5}


def test_the_cursor_brings_every_tenant_round_when_there_are_more_than_a_claim_takes():
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    tenants = [f"t{i:02d}" for i in range(12)]
    for tenant in tenants:
        enqueue(tenant, 3)
    after = ""
    seen: list[str] = []
    for _ in range(3):
        claimed = take(limits, asked=4, after={NAME: after})
        seen.extend(job.tenant for job in claimed)
        after = flow.next_cursor(after, [job.tenant for job in claimed])

    assert sorted(seen) == tenants  # twelve tenants, four a claim, each once


def test_rows_enqueued_before_a_type_became_fair_are_moved_into_tenant_order():
    enqueue("a", 3)
    assert not Job.objects.filter(fair=True).exists()

    flow.ensure({NAME: FlowLimits(fair=True)})
    assert Job.objects.filter(fair=True).count() == 3
    flow.ensure({NAME: FlowLimits(global_concurrency=2)})
    assert not Job.objects.filter(fair=True).exists()


def test_a_type_without_controls_keeps_the_plain_claim_statement():
    FlowGate.objects.create(name=NAME, tenant_ordered=True)
    enqueue("a", 2)

    with CaptureQueriesContext(connection) as queries:
        queue.claim([ClaimRequest("other.v1", 5)], scope=AllTenants())

    assert "jobs_flow" not in queries[-1]["sql"]


@pytest.mark.django_db(transaction=True)
def test_a_gate_held_by_another_claim_is_skipped_not_waited_for():
    limits = FlowLimits(global_concurrency=5)
    flow.ensure({NAME: limits})
    enqueue("a", 5)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:  # a claim of the type in progress on another connection
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SELECT 1 FROM jobs_flow WHERE name = %s FOR UPDATE", [NAME])
            locked.set()
            release.wait(10)
        connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    started = time.monotonic()
    assert take(limits) == []
    assert time.monotonic() - started < 1
    release.set()
    holder.join(10)
    assert len(take(limits)) == 5


def test_an_expired_bucket_refills_continuously_up_to_its_burst():
    limits = FlowLimits(rate=1.0, burst=3.0)
    flow.ensure({NAME: limits})
    enqueue("a", 20)
    assert len(take(limits)) == 3
    # A bucket last refilled 2.5 s ago holds 2.5 tokens: two starts, half a token left, and
    # whatever the time between the refill stamp and the claim added.
    started = time.monotonic()
    FlowGate.objects.filter(name=NAME).update(
        tokens=0.0, refilled_at=database_now() - timedelta(seconds=2.5)
    )
    assert len(take(limits)) == 2
    elapsed = time.monotonic() - started
    gate = FlowGate.objects.get(name=NAME)
    assert 0.5 <= gate.tokens <= 0.5 + elapsed * limits.rate, (gate.tokens, elapsed)
    # Long idle: never more than the burst.
    FlowGate.objects.filter(name=NAME).update(refilled_at=database_now() - timedelta(hours=1))
    assert len(take(limits)) == 3


def test_tenant_buckets_are_kept_per_tenant():
    limits = FlowLimits(tenant_rate=1.0, tenant_burst=2.0)
    flow.ensure({NAME: limits})
    enqueue("a", 5)
    enqueue("b", 5)
    assert sorted(job.tenant for job in take(limits)) == ["a", "a", "b", "b"]
    assert take(limits) == []
    assert {(b.tenant, b.tokens < 1) for b in TenantBucket.objects.all()} == {
        ("a", True),
        ("b", True),
    }


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_never_run_more_than_the_global_limit():
    limits = FlowLimits(global_concurrency=4)
    flow.ensure({NAME: limits})
    enqueue("a", 300)
    stop = threading.Event()
    peaks: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(7)

    def claimer() -> None:
        try:
            barrier.wait()
            while not stop.is_set():
                for job in take(limits, asked=3):
                    queue.complete(job)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    def watcher() -> None:
        barrier.wait()
        while not stop.is_set():
            peaks.append(Job.objects.filter(state="running").count())
        connection.close()

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    threads.append(threading.Thread(target=watcher))
    for thread in threads:
        thread.start()
    wait_for(
        lambda: Job.objects.filter(state="succeeded").count() >= 300 or errors,
        timeout=60,
        what="the backlog drained",
    )
    stop.set()
    for thread in threads:
        thread.join(10)

    assert not errors
    assert Job.objects.filter(state="succeeded").count() == 300
    assert max(peaks) <= 4
    assert max(peaks) >= 2  # the claimers did overlap


def test_a_fair_type_serves_its_highest_class_first_and_fills_from_the_classes_below(claim_form):
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    queue.enqueue_many([NewJob(NAME, {}, tenant="a", priority=5) for _ in range(3)])
    enqueue("a", 20)
    enqueue("b", 20)

    claimed = take(limits, asked=10)

    assert len(claimed) == 10
    assert sum(job.priority == 5 for job in claimed) == 3
    # Once the high class is done, the tenants share the class below.
    got = Counter(job.tenant for job in take(limits, asked=10))
    assert got == {"a": 5, "b": 5}


def test_with_a_tenant_limit_a_capped_tenants_high_class_does_not_hold_back_the_others():
    limits = FlowLimits(tenant_concurrency=1)
    flow.ensure({NAME: limits})
    queue.enqueue_many([NewJob(NAME, {}, tenant="a", priority=5) for _ in range(3)])
    enqueue("b", 3)

    assert sorted((job.tenant, job.priority) for job in take(limits)) == [("a", 5), ("b", 0)]


def test_a_share_for_lower_classes_goes_to_them_first_in_every_claim(claim_form):
    limits = FlowLimits(lower_share=0.25)
    flow.ensure({NAME: limits})
    queue.enqueue_many([NewJob(NAME, {}, tenant="a", priority=5) for _ in range(40)])
    enqueue("a", 40)

    claimed = take(limits, asked=8)

    assert [job.priority for job in claimed].count(0) == 2  # a quarter of 8
    assert [job.priority for job in claimed].count(5) == 6  # the rest highest first


def test_small_claims_keep_the_lower_share_on_average():
    limits = FlowLimits(lower_share=0.25)
    queue.enqueue_many([NewJob(NAME, {}, priority=5) for _ in range(200)])
    enqueue("a", 200)

    low = sum(job.priority == 0 for _ in range(200) for job in take(limits, asked=1))

    assert 25 <= low <= 75  # about 50 of 200 claims of one job (binomial, p = 0.25)


def test_the_lower_share_yields_to_the_top_class_when_nothing_below_is_due():
    limits = FlowLimits(lower_share=0.5)
    queue.enqueue_many([NewJob(NAME, {}, priority=5) for _ in range(10)])

    assert len(take(limits, asked=6)) == 6


def test_a_fair_type_keeps_the_lower_share_too(claim_form):
    limits = FlowLimits(fair=True, lower_share=0.5)
    flow.ensure({NAME: limits})
    queue.enqueue_many([NewJob(NAME, {}, tenant="a", priority=5) for _ in range(20)])
    queue.enqueue_many([NewJob(NAME, {}, tenant="b", priority=5) for _ in range(20)])
    enqueue("c", 20)

    got = Counter((job.tenant, job.priority) for job in take(limits, asked=8))

    assert got == {("c", 0): 4, ("a", 5): 2, ("b", 5): 2}


# (tenant, priority, due now) → how many queued jobs
class_backlogs = st.dictionaries(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from([-3, 0, 2, 5]), st.booleans()),
    st.integers(1, 6),
    min_size=1,
)


@example(backlog={("a", 5, False): 3, ("a", 0, True): 2}, asked=3, running=0)
@example(backlog={("a", 0, True): 4, ("b", 2, False): 1, ("b", -3, True): 2}, asked=9, running=3)
@given(backlog=class_backlogs, asked=st.integers(1, 12), running=st.integers(0, 4))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_mix_of_classes_is_claimed_highest_due_class_first(claim_form, backlog, asked, running):
    """Whatever the classes, their due and not yet due rows and the jobs already claimed from
    them, a fair claim takes the highest due class first and fills from the classes below:
    the priorities it takes are the first ones of all due rows in priority order."""
    limits = FlowLimits(fair=True)
    later = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        flow.ensure({NAME: limits})
        for (tenant, priority, due), count in backlog.items():
            queue.enqueue_many(
                [
                    NewJob(
                        NAME, {}, tenant=tenant, priority=priority, run_after=None if due else later
                    )
                    for _ in range(count)
                ]
            )
        taken = take(limits, asked=running) if running else []  # the last claim's jobs
        due_priorities = sorted(
            (p for (_, p, due), count in backlog.items() if due for _ in range(count)), reverse=True
        )[len(taken) :]

        claimed = take(limits, asked=asked)

        assert sorted((job.priority for job in claimed), reverse=True) == due_priorities[:asked]
        transaction.set_rollback(True)


def test_a_fair_claim_reads_each_tenants_due_rows_by_index_and_counts_them_once():
    """Measured in a drain: the count of a tenant's due rows was planned as a scan of the
    whole table (its LIMIT made the planner expect to stop early, but the claimed rows at the
    table's start come first) and evaluated twice, once per reference to it. The plans are
    read with auto_explain, which sees inside the pick function too."""
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    for _ in range(6):
        queue.enqueue_many([NewJob(NAME, {}, tenant=t) for t in ("a", "b") for _ in range(2500)])
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_job")
    claimed, nodes = explained_claim(lambda: take(limits, asked=100))
    assert len(claimed) == 100
    scans = [n for n in nodes if n.get("Relation Name") == "jobs_job"]
    assert scans, "auto_explain reported no plan"
    assert not [n for n in scans if n["Node Type"] == "Seq Scan"]
    per_tenant = [
        n
        for n in scans
        if n.get("Index Name") == "jobs_job_tenant_claim"
        and "tenant)::text = " in n.get("Index Cond", "")
        and n.get("Actual Loops", 0) > 0
    ]
    # Per tenant read, once each: a look for one due job (is it in the claim), one count of
    # its due rows (up to the claim's size) and one pull of its share.
    assert len(per_tenant) == 3, [n.get("Index Cond") for n in per_tenant]
    assert [n["Actual Loops"] for n in per_tenant] == [2, 2, 2]


def test_a_fair_claim_of_one_priority_class_does_not_cross_the_claimed_jobs_to_find_it(
    monkeypatch,
):
    """Measured in a drain: finding the highest class with due jobs read the claim index
    from its start twice a claim, stepping over the entries the last claims left there (not
    yet removed, so each is checked in the table) before the pull crossed them a third time.
    With one class there is nothing to find: its lowest queued priority, read from the live
    end of the index, has no class above it."""
    limits = FlowLimits(fair=True)
    # A name of its own: rows the tests before left dead in the table (rolled back) must not
    # sit in the part of the index this test reads.
    name = "flow.crossing.v1"
    flow.ensure({name: limits})
    inserted_row_by_row(monkeypatch)
    enqueue("a", 3000, name)
    with connection.cursor() as cur:
        cur.execute("ANALYZE jobs_job")
    with transaction.atomic():
        assert len(take(limits, 1000, name=name) + take(limits, 1000, name=name)) == 2000
        claimed, nodes = explained_claim(lambda: take(limits, asked=10, name=name))
    assert len(claimed) == 10
    reads = [
        (n.get("Index Cond"), n["Shared Hit Blocks"] + n["Shared Read Blocks"])
        for n in nodes
        if n.get("Relation Name") == "jobs_job" and n["Node Type"] != "ModifyTable"
    ]
    assert reads, "auto_explain reported no plan"
    # The 2,000 claimed entries span hundreds of pages: only the pull of the ten may cross them.
    crossings = [read for read in reads if read[1] > 200]
    assert len(crossings) == 1, crossings


def put(tenant: str, count: int, name: str = NAME, **fields) -> None:
    queue.enqueue_many([NewJob(name, {}, tenant=tenant, **fields) for _ in range(count)])


def claims_like_a_worker(limits, asked, rounds, *, scope=None, cap=None) -> list[str]:
    """``rounds`` claims of ``asked`` moving the tenant cursor on as the worker does; the
    tenants of the jobs claimed, in order."""
    cursor = ""
    tenants: list[str] = []
    for _ in range(rounds):
        claimed = take(limits, asked, scope=scope, after={NAME: cursor}, cap=cap)
        cursor = flow.next_cursor(cursor, [job.tenant for job in claimed])
        tenants.extend(job.tenant for job in claimed)
    return tenants


@pytest.mark.django_db
def test_a_tenant_with_only_delayed_jobs_does_not_starve_a_due_tenant(claim_form):
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 1, delay=timedelta(hours=1))  # scheduled for later
    put("b", 3)

    # A worker with one free slot claims one at a time, as workers of concurrency 1 do.
    assert claims_like_a_worker(limits, 1, rounds=5) == ["b", "b", "b"]


@pytest.mark.django_db
def test_a_tenant_scoped_worker_claims_its_tenant_of_a_tenant_limited_type(claim_form):
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 3)
    put("z", 3)

    assert claims_like_a_worker(limits, 1, rounds=4, scope=OnlyTenant("z")) == ["z"] * 3


@pytest.mark.django_db
def test_a_base_worker_claims_past_a_tenant_it_does_not_serve(claim_form):
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    TenantOverrideFactory(tenant="a", component="worker")  # tenant a has its own workers
    put("a", 3)
    put("b", 3)

    got = claims_like_a_worker(limits, 1, rounds=4, scope=AllTenantsExcept("worker"))
    assert got == ["b"] * 3


@pytest.mark.django_db
def test_a_paused_queue_of_one_tenant_does_not_hold_back_the_other_tenants(claim_form):
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 3, queue="bulk")
    put("b", 3)
    queue.pause("queue", "bulk", by="operator")

    assert claims_like_a_worker(limits, 1, rounds=4) == ["b"] * 3
    assert Counter(job.tenant for job in take(limits, 2)) == {}  # b is done; a is paused


@pytest.mark.django_db
def test_a_tenant_past_the_attempt_cap_does_not_take_a_place(claim_form):
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 2)
    Job.objects.filter(tenant="a").update(attempts=2)  # two attempts made already
    put("b", 2)

    # The worker's request caps attempts at 2 (a policy's max_attempts lowered since).
    assert claims_like_a_worker(limits, 1, rounds=3, cap=2) == ["b", "b"]


@pytest.mark.django_db
def test_a_tenant_with_due_work_and_a_delayed_tenant_with_room_to_spare(claim_form):
    # What does hold: with a claim larger than the tenants, the delayed tenant's share goes
    # to the due one in round two, and a paused tenant is left out of the list altogether.
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    put("a", 1, delay=timedelta(hours=1))
    put("b", 3)
    put("c", 3)
    queue.pause("tenant", "c", by="operator")

    assert Counter(job.tenant for job in take(limits, 4)) == {"b": 3}


@pytest.mark.django_db
def test_a_job_running_when_its_type_became_tenant_ordered_runs_after_its_retry():
    put("a", 1)
    held = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants())  # the old deploy's worker
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})  # the new deploy's first worker starts
    queue.retry(held[0], code="handler_error")  # the old worker's attempt failed
    flow.ensure({NAME: limits})  # and another worker starts

    assert [job.id for job in take(limits, 5)] == [held[0].id]


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_across_the_flip_runs_after_the_next_worker_start():
    inserted, flipped = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            with transaction.atomic():
                put("a", 1)
                inserted.set()
                assert flipped.wait(10)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=producer)
    thread.start()
    assert inserted.wait(10)
    limits = FlowLimits(tenant_concurrency=5)
    flow.ensure({NAME: limits})
    flipped.set()
    thread.join(10)
    assert not errors
    flow.ensure({NAME: limits})  # "until the next worker start", the docstring says

    assert len(take(limits, 5)) == 1


@pytest.mark.django_db
def test_replay_and_the_tasks_paths_put_rows_in_tenant_order():
    limits = FlowLimits(fair=True, tenant_concurrency=3)
    flow.ensure({NAME: limits})
    put("a", 1)
    job = take(limits, 1)[0]
    queue.fail(job, code="handler_error")
    Job.objects.filter(pk=job.id).update(fair=False)  # as if it ran before the flip
    queue.replay([job.id], by="operator")
    assert Job.objects.get(pk=job.id).fair is True
    assert [j.id for j in take(limits, 1)] == [job.id]


@pytest.mark.django_db
def test_rows_of_a_type_no_longer_tenant_ordered_are_still_claimed():
    flow.ensure({NAME: FlowLimits(fair=True)})
    put("a", 2)
    held = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants())
    plain = FlowLimits(global_concurrency=5)
    flow.ensure({NAME: plain})  # the type stops being tenant-ordered
    queue.retry(held[0], code="handler_error")  # its row comes back with fair=true

    assert len(take(plain, 5)) == 2


@pytest.mark.django_db
def test_a_fair_type_stays_fair_while_its_highest_class_is_paused(claim_form):
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    put("a", 20)
    put("b", 20)
    put("c", 1, queue="bulk", priority=5)
    queue.pause("queue", "bulk", by="operator")

    assert Counter(job.tenant for job in take(limits, 10)) == {"a": 5, "b": 5}


@pytest.mark.django_db
def test_a_fair_type_stays_fair_beside_a_high_class_out_of_scope(claim_form):
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    TenantOverrideFactory(tenant="c", component="worker")
    put("a", 20)
    put("b", 20)
    put("c", 1, priority=5)

    got = take(limits, 10, scope=AllTenantsExcept("worker"))
    assert Counter(job.tenant for job in got) == {"a": 5, "b": 5}


@pytest.mark.django_db
def test_weighted_shares_hand_what_a_tenant_cannot_use_to_the_others(claim_form):
    limits = FlowLimits(fair=True, tenant_concurrency=4)
    flow.ensure({NAME: limits})
    TenantWeight.objects.create(tenant="heavy", weight=5)
    put("heavy", 10)
    put("light", 10)
    put("tiny", 1)

    got = Counter(job.tenant for job in take(limits, 9))
    # heavy is held to its tenant limit; tiny has one job; light takes the rest.
    assert got == {"heavy": 4, "light": 4, "tiny": 1}


@pytest.mark.django_db
@pytest.mark.xfail(
    strict=True,
    reason="next_cursor compares tenants in Python (code points) while the claim walks them "
    "in the column's collation: under a linguistic collation a tenant is served twice "
    "while another waits",
)
def test_the_cursor_follows_the_database_order_of_tenants():
    # A database created with a linguistic default collation (en_US.UTF-8 and the like, a
    # common default) orders tenants so; this test's table is made to, for its length.
    for collation in ("unicode", "en-x-icu", "en_US.utf8", "en_US"):
        try:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(
                    "ALTER TABLE jobs_job ALTER COLUMN tenant TYPE varchar(64) "
                    f'COLLATE "{collation}"'
                )
                cur.execute(f"SELECT 'a' < 'B' COLLATE \"{collation}\"")
                if not cur.fetchone()[0]:
                    raise ValueError("not a linguistic order")
            break
        except Exception:  # this server lacks it (no ICU, no such locale): try the next
            continue
    else:
        pytest.skip("no linguistic collation on this server")
    limits = FlowLimits(fair=True)
    flow.ensure({NAME: limits})
    for tenant in ("a", "B", "c", "D"):  # "unicode": a < B < c < D; code points: B < D < a < c
        put(tenant, 5)

    first = take(limits, 2, after={NAME: ""})  # highest first
    assert {job.tenant for job in first} == {"D", "c"}
    cursor = flow.next_cursor("", [job.tenant for job in first])
    second = take(limits, 2, after={NAME: cursor})
    assert {job.tenant for job in second} == {"B", "a"}


@pytest.mark.django_db
def test_next_cursor_wraps_round():
    assert flow.next_cursor("", []) == ""
    assert flow.next_cursor("m", []) == "m"
    assert flow.next_cursor("", ["a", "b"]) == "a"
    assert flow.next_cursor("m", ["b", "a"]) == "a"
    assert flow.next_cursor("m", ["b", "x"]) == "x"  # wrapped: x was reached last


@pytest.mark.django_db
def test_two_requests_for_one_limited_name_stay_within_its_global_limit():
    limits = FlowLimits(global_concurrency=2)
    flow.ensure({NAME: limits})
    put("a", 6)

    queue.claim(
        [ClaimRequest(NAME, 2), ClaimRequest(NAME, 2)],
        scope=AllTenants(),
        limits={NAME: limits},
    )

    assert Job.objects.filter(state="running").count() <= 2


@pytest.mark.django_db
def test_the_combined_statement_starts_the_place_its_outcome_frees():
    limits = FlowLimits(global_concurrency=1)
    flow.ensure({NAME: limits})
    put("a", 3)
    (first,) = take(limits, 1)

    _, claimed = queue.record_and_claim(
        [Outcome.succeeded(first)],
        [ClaimRequest(NAME, 1)],
        scope=AllTenants(),
        limits={NAME: limits},
    )

    assert len(claimed) == 1


@pytest.mark.django_db
def test_the_combined_statement_never_passes_the_limits():
    limits = FlowLimits(global_concurrency=2, tenant_concurrency=1)
    flow.ensure({NAME: limits})
    put("a", 3)
    put("b", 3)
    first = take(limits, 5)
    assert sorted(job.tenant for job in first) == ["a", "b"]

    # Ending one job and claiming in the same statement cannot reuse the place twice.
    _, claimed = queue.record_and_claim(
        [Outcome.succeeded(first[0])],
        [ClaimRequest(NAME, 5)],
        scope=AllTenants(),
        limits={NAME: limits},
    )
    assert len(claimed) <= 1
    assert Job.objects.filter(state="running").count() <= 2


def _hammer(claimer, *, threads: int, until, watch) -> list:
    """Run ``claimer`` in threads while ``watch`` samples, until ``until()``; the samples."""
    stop = threading.Event()
    samples: list = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def claiming(index: int) -> None:
        try:
            barrier.wait(10)
            while not stop.is_set():
                claimer(index)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    def watching() -> None:
        try:
            barrier.wait(10)
            while not stop.is_set():
                samples.append(watch())
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=claiming, args=(i,)) for i in range(threads)]
    workers.append(threading.Thread(target=watching))
    for thread in workers:
        thread.start()
    try:
        wait_for(lambda: until() or errors, timeout=60, what="the claimers finished")
    finally:
        stop.set()
        for thread in workers:
            thread.join(15)
    assert not errors, errors
    return samples


@pytest.mark.django_db(transaction=True)
def test_concurrent_combined_claims_hold_the_tenant_and_global_limits():
    limits = FlowLimits(global_concurrency=5, tenant_concurrency=2, fair=True)
    flow.ensure({NAME: limits})
    for tenant in ("a", "b", "c", "d"):
        put(tenant, 40)
    held: dict[int, list] = {i: [] for i in range(6)}
    cursors: dict[int, str] = dict.fromkeys(range(6), "")

    def claimer(index: int) -> None:
        # Each claimer ends what it holds and claims in one statement, as workers do.
        outcomes = [Outcome.succeeded(job) for job in held[index]]
        _, claimed = queue.record_and_claim(
            outcomes,
            [ClaimRequest(NAME, 3)],
            scope=AllTenants(),
            limits={NAME: limits},
            after={NAME: cursors[index]},
        )
        cursors[index] = flow.next_cursor(cursors[index], [job.tenant for job in claimed])
        held[index] = claimed

    def watch():
        with connection.cursor() as cur:  # one snapshot: a consistent count
            cur.execute("SELECT tenant, count(*) FROM jobs_job WHERE state = 'running' GROUP BY 1")
            return dict(cur.fetchall())

    samples = _hammer(
        claimer,
        threads=6,
        until=lambda: Job.objects.filter(state="queued").count() == 0,
        watch=watch,
    )

    assert max(sum(s.values()) for s in samples) <= 5
    assert max(max(s.values(), default=0) for s in samples) <= 2
    assert max(sum(s.values()) for s in samples) >= 3  # the claimers did overlap


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_never_take_more_than_the_bucket_holds():
    rate, burst = 40.0, 4.0
    limits = FlowLimits(rate=rate, burst=burst, tenant_rate=25.0, tenant_burst=2.0)
    flow.ensure({NAME: limits})
    put("a", 200)
    put("b", 200)
    started = time.monotonic()
    took: list[tuple[float, int]] = []
    lock = threading.Lock()

    def claimer(index: int) -> None:
        for job in take(limits, 3):
            queue.complete(job)
            with lock:
                took.append((time.monotonic(), 1))

    def watch():
        gate = FlowGate.objects.get(name=NAME)
        return gate.tokens

    deadline = started + 1.5
    samples = _hammer(claimer, threads=6, until=lambda: time.monotonic() > deadline, watch=watch)
    elapsed = time.monotonic() - started

    assert len(took) <= burst + rate * elapsed + 1
    assert len(took) >= rate * 1.0  # the bucket was used, not starved by the gate
    assert min(t for t in samples if t is not None) >= 0
    assert max(t for t in samples if t is not None) <= burst
    with connection.cursor() as cur:
        cur.execute("SELECT tokens FROM jobs_flowtenant")
        buckets = [tokens for (tokens,) in cur.fetchall()]
    assert buckets and all(0 <= tokens <= 2.0 for tokens in buckets)


@pytest.mark.django_db(transaction=True)
def test_a_claim_in_an_open_transaction_holds_the_gate_until_it_commits():
    limits = FlowLimits(global_concurrency=3)
    flow.ensure({NAME: limits})
    put("a", 10)
    claimed, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            with transaction.atomic():
                assert len(take(limits, 2)) == 2
                claimed.set()
                assert release.wait(10)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=caller)
    thread.start()
    assert claimed.wait(10)
    assert take(limits, 5) == []  # the gate is held: skipped, not waited for
    release.set()
    thread.join(10)
    assert not errors
    assert len(take(limits, 5)) == 1  # its two starts count once committed


@pytest.mark.django_db(transaction=True)
def test_a_running_worker_makes_a_missing_gate_row_again():
    recorder = Recorder()
    registry = Registry(
        [JobType(Echo, echo_handler(recorder), Policy(concurrency=2, global_concurrency=2))]
    )
    worker = Worker(registry, WorkerConfig(poll_interval=0.05, install_signal_handlers=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        enqueue_job(Echo(text="one"))
        wait_for(lambda: Job.objects.filter(state="succeeded").count() == 1, timeout=10)
        FlowGate.objects.all().delete()  # a restore or a cleanup drops the small table
        enqueue_job(Echo(text="two"))
        wait_for(
            lambda: Job.objects.filter(state="succeeded").count() == 2,
            timeout=5,
            what="the second job ran",
        )
    finally:
        worker.request_stop(force=True)
        thread.join(15)


@pytest.mark.django_db(transaction=True)
def test_a_flood_of_enqueues_does_not_undo_the_hold_back_of_a_full_type(monkeypatch):
    import jobs.queue as jobs_queue

    claims: list[float] = []
    claim, record_and_claim = jobs_queue.claim, jobs_queue.record_and_claim

    def counted_claim(requests, **options):
        if any(r.name == "test.step.v1" for r in requests):
            claims.append(time.monotonic())
        return claim(requests, **options)

    def counted_record_and_claim(outcomes, requests, **options):
        if any(r.name == "test.step.v1" for r in requests):
            claims.append(time.monotonic())
        return record_and_claim(outcomes, requests, **options)

    monkeypatch.setattr(jobs_queue, "claim", counted_claim)
    monkeypatch.setattr(jobs_queue, "record_and_claim", counted_record_and_claim)
    recorder = Recorder()
    registry = Registry(
        [JobType(Step, scripted(recorder), Policy(concurrency=4, global_concurrency=1))]
    )
    enqueue_job(Step(plan=("slow",), seconds=5))  # holds the type's one place
    worker = Worker(registry, WorkerConfig(install_signal_handlers=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: recorder.calls, timeout=10, what="the long job started")
        wait_for(lambda: worker.listening, timeout=10, what="the listener")
        before = len(claims)
        flood_until = time.monotonic() + 2.0
        while time.monotonic() < flood_until:
            enqueue_job(Step(plan=("ok",)))
            time.sleep(0.005)
        during = len(claims) - before
    finally:
        worker.request_stop(force=True)
        thread.join(15)

    # Held back from 50 ms doubling to the poll interval: a handful of claims in 2 s.
    assert during <= 20, during


@pytest.mark.django_db
def test_a_huge_rate_is_refused_or_claims():
    try:
        rate = Rate(1_000_000_000, per=0.001)
    except ValueError:
        return  # refused up front: fine
    limits = limits_of(Policy(rate_limit=rate))
    flow.ensure({NAME: limits})
    put("a", 2)

    assert len(take(limits, 2)) == 2
