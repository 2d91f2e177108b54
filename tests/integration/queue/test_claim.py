"""Claim: order, capacity, scopes, skip-locked under real concurrent connections, leases."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.queue import AllTenants, AllTenantsExcept, ClaimRequest, NewJob, OnlyTenant
from jobs.queue.history import HOUR
from tests.support.concurrency import Background
from tests.support.factories import JobFactory, TenantOverrideFactory
from tests.support.history import MINUTE, NAME

pytestmark = pytest.mark.django_db


def claim(*names, limit=None, scope=None, per_name=10, **kwargs):
    requests = [ClaimRequest(name, per_name) for name in names or ("test.noop.v1",)]
    return queue.claim(requests, scope=scope or AllTenants(), limit=limit, **kwargs)


def test_claim_marks_running_with_token_lease_and_attempt():
    queued = JobFactory()

    [job] = claim(worker="host:1")

    row = Job.objects.get(pk=queued.pk)
    assert (row.state, row.attempts, row.claimed_by) == ("running", 1, "host:1")
    assert row.claim_token == job.claim_token is not None
    assert row.lease_expires_at - row.started_at == timedelta(seconds=10)
    assert row.heartbeat_at == row.started_at
    assert job.attempts == 1 and not job.final_attempt


def test_claim_order_is_priority_then_due_time_then_age():
    now = timezone.now()
    low_old = JobFactory(priority=0, run_after=now - timedelta(minutes=10))
    high_new = JobFactory(priority=10, run_after=now - timedelta(minutes=1))
    high_old = JobFactory(priority=10, run_after=now - timedelta(minutes=5))
    JobFactory(priority=100, run_after=now + timedelta(minutes=5))  # not due

    claimed = claim(per_name=10)

    assert [job.id for job in claimed] == [high_old.id, high_new.id, low_old.id]


def test_claim_never_exceeds_per_name_or_total_limits():
    JobFactory.create_batch(5, name="a.v1")
    JobFactory.create_batch(5, name="b.v1")

    first = queue.claim(
        [ClaimRequest("a.v1", 2), ClaimRequest("b.v1", 4)], scope=AllTenants(), limit=5
    )

    assert sorted(job.name for job in first) == ["a.v1", "a.v1", "b.v1", "b.v1", "b.v1"]
    assert queue.claim([ClaimRequest("a.v1", 0)], scope=AllTenants()) == []


def test_names_are_served_in_the_order_given():
    JobFactory.create_batch(3, name="a.v1")
    JobFactory.create_batch(3, name="b.v1")

    claimed = queue.claim(
        [ClaimRequest("b.v1", 3), ClaimRequest("a.v1", 3)], scope=AllTenants(), limit=4
    )

    assert [job.name for job in claimed].count("b.v1") == 3


def test_claim_skips_jobs_out_of_attempts_and_honours_a_lowered_limit():
    JobFactory(attempts=5, max_attempts=5)
    middle = JobFactory(attempts=2, max_attempts=5)

    assert queue.claim([ClaimRequest("test.noop.v1", 10, max_attempts=2)], scope=AllTenants()) == []
    assert [job.id for job in claim()] == [middle.id]


def test_unrequested_names_stay_queued():
    JobFactory(name="unsupported.v1")
    assert claim("test.noop.v1") == []
    assert Job.objects.get().state == "queued"


class TestScopes:
    def test_base_scope_skips_tenants_overridden_for_its_component(self):
        JobFactory(tenant="acme")
        kept = JobFactory(tenant="globex")
        TenantOverrideFactory(tenant="acme", component="worker")
        TenantOverrideFactory(tenant="globex", component="mailer")  # another component

        claimed = claim(scope=AllTenantsExcept("worker"))

        assert [job.id for job in claimed] == [kept.id]

    def test_branch_scope_takes_only_its_tenant_whatever_the_overrides(self):
        branch = JobFactory(tenant="acme")
        JobFactory(tenant="globex")
        TenantOverrideFactory(tenant="acme", component="worker")

        claimed = claim(scope=OnlyTenant("acme"))

        assert [job.id for job in claimed] == [branch.id]

    @pytest.mark.parametrize("bad", ["", "has space", "x" * 65, None])
    def test_scopes_refuse_invalid_keys(self, bad):
        with pytest.raises(ValueError, match="must be 1-64 characters"):
            OnlyTenant(bad)
        with pytest.raises(ValueError, match="must be 1-64 characters"):
            AllTenantsExcept(bad)


@pytest.mark.django_db(transaction=True)
class TestConcurrentClaims:
    def test_two_connections_never_receive_the_same_job(self, threads):
        queue.enqueue_many([NewJob("c.v1") for _ in range(300)])

        def drain(_):
            mine = []
            while batch := queue.claim([ClaimRequest("c.v1", 7)], scope=AllTenants()):
                mine.extend(job.id for job in batch)
            return mine

        first, second = threads(2, drain)

        assert not set(first) & set(second)
        assert len(first) + len(second) == 300
        assert first and second, "both connections should have claimed some jobs"

    def test_a_claim_skips_rows_locked_by_an_open_claim(self):
        queue.enqueue_many([NewJob("c.v1") for _ in range(4)])
        holding = threading.Event()
        release = threading.Event()
        held: list = []

        def hold_open_claim():
            try:
                with transaction.atomic():
                    held.extend(queue.claim([ClaimRequest("c.v1", 2)], scope=AllTenants()))
                    holding.set()
                    assert release.wait(10)
            finally:
                connection.close()

        thread = threading.Thread(target=hold_open_claim)
        thread.start()
        try:
            assert holding.wait(10)
            other = queue.claim([ClaimRequest("c.v1", 4)], scope=AllTenants())
        finally:
            release.set()
            thread.join(10)

        assert len(held) == 2 and len(other) == 2
        assert not {j.id for j in held} & {j.id for j in other}


class TestLeases:
    def test_renew_extends_leases_and_stamps_the_heartbeat(self):
        JobFactory.create_batch(2)
        jobs = claim()
        Job.objects.update(lease_expires_at=timezone.now(), heartbeat_at=None)

        lost = queue.renew(jobs, lease=timedelta(seconds=30))

        assert lost == set()
        for row in Job.objects.all():
            assert row.heartbeat_at is not None
            assert row.lease_expires_at - row.heartbeat_at == timedelta(seconds=30)

    def test_renew_reports_jobs_whose_token_no_longer_matches(self):
        JobFactory.create_batch(2)
        kept, taken = claim()
        Job.objects.filter(pk=taken.id).update(
            state="queued", claim_token=None, lease_expires_at=None
        )

        assert queue.renew([kept, taken]) == {taken.id}


@pytest.mark.django_db
def test_claim_walks_priorities_in_order_past_delayed_and_other_tenants_rows():
    """The walk keeps (priority DESC, run_after, id) and the tenant scope.

    Delayed rows and rows of another tenant at higher priorities are stepped over, never
    claimed; the due rows come highest priority first, earliest due first within one.
    """
    now = database_now()
    jobs = [
        NewJob(name=NAME, payload={}, priority=50, run_after=now + HOUR, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=40, tenant="t2"),
        NewJob(name=NAME, payload={}, priority=30, run_after=now - 2 * MINUTE, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=30, run_after=now - 5 * MINUTE, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=-100, tenant="t1"),
        NewJob(name=NAME, payload={}, priority=100, run_after=now + HOUR, tenant="t1"),
    ]
    ids = [e.id for e in queue.enqueue_many(jobs)]

    claimed = queue.claim([ClaimRequest(NAME, 10)], scope=OnlyTenant("t1"), worker="w")

    assert [c.id for c in claimed] == [ids[3], ids[2], ids[4]]


@pytest.mark.django_db(transaction=True)
def test_claim_locks_only_what_it_takes():
    """Rows are locked only as the LIMIT pulls them, across priorities and names.

    Inside an open claim of 3 (two names, three priorities), every other due row can still be
    locked by another session with SKIP LOCKED.
    """
    other = "test.history.other.v1"
    jobs = [NewJob(name=NAME, payload={}, priority=p) for p in (5, 5, 0, 0, -5, -5)]
    jobs += [NewJob(name=other, payload={}, priority=1) for _ in range(4)]
    queue.enqueue_many(jobs)
    held, release = threading.Event(), threading.Event()

    def claim_held_open() -> Any:
        with transaction.atomic():
            got = queue.claim(
                [ClaimRequest(NAME, 2), ClaimRequest(other, 4)],
                scope=AllTenants(),
                limit=3,
                worker="w",
            )
            held.set()
            release.wait(60)
        return got

    claimer = Background(claim_held_open)
    assert held.wait(30)
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM (SELECT id FROM jobs_job WHERE state = 'queued' "
                "FOR UPDATE SKIP LOCKED) s"
            )
            (lockable,) = cur.fetchone()
    finally:
        release.set()
    got = claimer.result()
    assert len(got) == 3
    assert [c.priority for c in got[:2]] == [5, 5] and got[2].name == other
    assert lockable == 10 - 3
