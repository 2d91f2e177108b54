"""Maintenance passes: expired leases, exhaustion and retention (backlog: test_backlog.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, AllTenantsExcept, ClaimRequest, OnlyTenant
from tests.support.factories import JobFactory, TenantOverrideFactory

pytestmark = pytest.mark.django_db

SECOND = timedelta(seconds=1)


def expired_lease():
    return timezone.now() - SECOND


class TestExpiredLeases:
    def test_expired_lease_makes_the_job_claimable_again(self):
        job = JobFactory(running=True, attempts=1, lease_expires_at=expired_lease())
        JobFactory(running=True, attempts=1)  # lease still valid: untouched

        swept = queue.requeue_expired()

        assert [(r.id, r.state) for r in swept] == [(job.id, "queued")]
        row = Job.objects.get(pk=job.pk)
        assert (row.state, row.claim_token, row.last_error) == ("queued", None, "lease_expired")
        [again] = queue.claim([ClaimRequest("test.noop.v1", 5)], scope=AllTenants())
        assert (again.id, again.attempts) == (job.id, 2)

    def test_cutoff_is_the_lease_itself(self):
        now = timezone.now()
        inside = JobFactory(running=True, lease_expires_at=now + SECOND)
        outside = JobFactory(running=True, lease_expires_at=now - SECOND)
        assert [r.id for r in queue.requeue_expired(now=now)] == [outside.id]
        assert Job.objects.get(pk=inside.pk).state == "running"

    def test_expired_lease_on_the_last_attempt_fails_the_job(self):
        job = JobFactory(running=True, attempts=3, max_attempts=3, lease_expires_at=expired_lease())

        assert queue.requeue_expired() == []
        swept = queue.fail_exhausted()

        assert [(r.id, r.state) for r in swept] == [(job.id, "failed")]
        row = Job.objects.get(pk=job.pk)
        assert (row.state, row.last_error) == ("failed", "lease_expired")
        assert row.finished_at is not None and row.claim_token is None

    def test_queued_job_at_a_lowered_limit_fails_as_exhausted(self):
        lowered = JobFactory(attempts=3, max_attempts=5)
        fine = JobFactory(attempts=1, max_attempts=5)
        other = JobFactory(name="other.v1", attempts=3, max_attempts=5)

        swept = queue.fail_exhausted(max_attempts={"test.noop.v1": 3})

        assert [r.id for r in swept] == [lowered.id]
        assert Job.objects.get(pk=lowered.pk).last_error == "attempts_exhausted"
        assert Job.objects.get(pk=fine.pk).state == "queued"
        assert Job.objects.get(pk=other.pk).state == "queued"

    def test_base_scope_does_not_touch_overridden_tenants(self):
        JobFactory(tenant="acme", running=True, attempts=5, lease_expires_at=expired_lease())
        JobFactory(tenant="acme", running=True, attempts=1, lease_expires_at=expired_lease())
        TenantOverrideFactory(tenant="acme", component="worker")
        base = AllTenantsExcept("worker")

        assert queue.fail_exhausted(scope=base) == []
        assert queue.requeue_expired(scope=base) == []
        assert len(queue.fail_exhausted(scope=OnlyTenant("acme"))) == 1
        assert len(queue.requeue_expired(scope=OnlyTenant("acme"))) == 1

    def test_passes_are_bounded(self):
        JobFactory.create_batch(5, running=True, lease_expires_at=expired_lease())
        assert len(queue.requeue_expired(limit=3)) == 3
        assert len(queue.requeue_expired(limit=3)) == 2


class TestPrune:
    def test_removes_only_rows_older_than_their_retention(self):
        now = timezone.now()
        day = timedelta(days=1)
        old_ok = JobFactory(succeeded=True, finished_at=now - day - SECOND)
        new_ok = JobFactory(succeeded=True, finished_at=now - day + SECOND)
        old_failed = JobFactory(failed=True, finished_at=now - 14 * day - SECOND)
        new_failed = JobFactory(failed=True, finished_at=now - 14 * day + SECOND)
        active = JobFactory()

        deleted = queue.prune(now=now)

        assert deleted == {"succeeded": 1, "failed": 1, "cancelled": 0}
        remaining = set(Job.objects.values_list("pk", flat=True))
        assert remaining == {new_ok.pk, new_failed.pk, active.pk}
        assert old_ok.pk not in remaining and old_failed.pk not in remaining

    def test_deletes_in_bounded_batches(self):
        old = timezone.now() - timedelta(days=30)
        JobFactory.create_batch(5, succeeded=True, finished_at=old)

        first = queue.prune(batch_size=2, max_batches=1)
        rest = queue.prune(batch_size=2, max_batches=10)

        assert first["succeeded"] == 2
        assert rest["succeeded"] == 3
        assert not Job.objects.exists()
