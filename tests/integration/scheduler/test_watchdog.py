"""The watchdog over the jobs table and every run-contract table, with rows on both sides of
each cutoff."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from prometheus_client import REGISTRY

from jobs.catalogue.registry import get_registry
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.scheduler import watchdog as watchdog_module
from jobs.scheduler.watchdog import Watchdog, WatchdogConfig
from tests.runapp.models import Delivery, QuickRun
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

SECOND = timedelta(seconds=1)


@pytest.fixture
def now():
    return database_now()


def running(model, job_id: str, *, beat=None, created=None):
    row = model.objects.create(job_id=job_id, state="running", attempts=1)
    model.objects.filter(pk=row.pk).update(heartbeat_at=beat, created_at=created or row.created_at)
    return row


def state(row) -> tuple[str, str]:
    row.refresh_from_db()
    return row.state, row.last_error


def reaped(table: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "jobs_scheduler_reaped_total", {"table": table, "outcome": outcome}
    )
    return value or 0.0


def watchdog(**config) -> Watchdog:
    return Watchdog(WatchdogConfig(**config), max_attempts=get_registry().max_attempts())


class TestJobsTable:
    def test_expired_leases_follow_the_retry_policy_and_live_leases_stay(self, now):
        retry = JobFactory(running=True, attempts=1, lease_expires_at=now - SECOND)
        last = JobFactory(running=True, attempts=5, lease_expires_at=now - SECOND)
        # A live lease is never reaped for an old heartbeat: the jobs table is lease-based.
        alive = JobFactory(
            running=True, lease_expires_at=now + SECOND, heartbeat_at=now - timedelta(days=1)
        )
        # jobapp.ping.v1 now allows 4 attempts; this one was enqueued under a higher limit.
        over = JobFactory(name="jobapp.ping.v1", attempts=4, max_attempts=9)

        counts = watchdog().run_once(now)

        assert counts == {"jobs.job:requeued": 1, "jobs.job:failed": 2}
        assert state(retry) == ("queued", "lease_expired")
        assert state(last) == ("failed", "lease_expired")
        assert state(over) == ("failed", "attempts_exhausted")
        assert state(alive) == ("running", "")


class TestRunTables:
    def test_stale_rows_fail_and_free_their_lock_and_fresh_ones_stay(self, now, caplog):
        stale_after = timedelta(seconds=60)  # JOBS["STALE_AFTER"]
        stale = running(Delivery, "mail-1", beat=now - stale_after - SECOND)
        fresh = running(Delivery, "mail-2", beat=now - stale_after + SECOND)
        never_beat = running(Delivery, "mail-3", created=now - stale_after - SECOND)
        young = running(Delivery, "mail-4", created=now - stale_after + SECOND)
        queued = Delivery.objects.create(job_id="mail-5")
        Delivery.objects.filter(pk=queued.pk).update(created_at=now - timedelta(days=1))
        quick_stale = running(QuickRun, "run-1", beat=now - 2 * SECOND)  # its own stale_after
        quick_fresh = running(QuickRun, "run-2", beat=now - SECOND / 2)
        with pytest.raises(IntegrityError), transaction.atomic():
            Delivery.objects.create(job_id="mail-1", state="queued")  # the lock holds
        before = reaped("runapp.delivery", "stale")

        counts = watchdog().run_once(now)

        assert counts == {"runapp.delivery:stale": 2, "runapp.quickrun:stale": 1}
        assert state(stale) == state(never_beat) == state(quick_stale) == ("failed", "stale")
        assert state(fresh) == state(young) == state(quick_fresh) == ("running", "")
        assert state(queued) == ("queued", "")
        assert reaped("runapp.delivery", "stale") == before + 2
        assert f"reaped as stale 2 rows of runapp.delivery: ids {[stale.pk, never_beat.pk]}" in (
            caplog.text
        )
        # The active-state lock is free again: the next run with the same key may start.
        Delivery.objects.create(job_id="mail-1", state="running")

    def test_batches_are_bounded(self, now):
        rows = [running(Delivery, f"mail-{i}", beat=now - timedelta(hours=1)) for i in range(5)]
        dog = watchdog(batch_size=2, max_batches=2)
        assert dog.run_once(now) == {"runapp.delivery:stale": 4}
        assert dog.run_once(now) == {"runapp.delivery:stale": 1}
        assert {state(row)[0] for row in rows} == {"failed"}

    def test_a_failing_table_does_not_stop_the_pass(self, now, monkeypatch):
        real = watchdog_module.reap_stale

        def broken(model, **kwargs):
            if model is Delivery:
                raise RuntimeError("table is locked")
            return real(model, **kwargs)

        monkeypatch.setattr(watchdog_module, "reap_stale", broken)
        quick = running(QuickRun, "run-1", beat=now - timedelta(hours=1))
        counts = watchdog().run_once(now)
        assert counts == {"errors": 1, "runapp.quickrun:stale": 1}
        assert state(quick) == ("failed", "stale")

    def test_the_jobs_table_is_not_reaped_by_heartbeat(self):
        assert Job.reaped_when_stale is False
        assert Delivery.reaped_when_stale and QuickRun.reaped_when_stale
