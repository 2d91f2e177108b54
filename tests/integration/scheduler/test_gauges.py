"""The gauges duty: the backlog and the jobs table's health, exported by the leader alone."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client import REGISTRY

from jobs import queue
from jobs.catalogue.registry import get_registry
from jobs.models import Job
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.gauges import Gauges
from jobs.scheduler.leader import LOCK_KEY, Leadership
from jobs.scheduler.runner import Scheduler
from tests.support.factories import JobFactory
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

KEY = LOCK_KEY + 11  # not the real scheduler's lock


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture(autouse=True)
def fresh_gauges():
    Gauges([]).withdraw()
    yield
    Gauges([]).withdraw()


class TestBacklog:
    def test_queued_jobs_per_type_and_registered_types_at_zero(self):
        now = timezone.now()
        JobFactory.create_batch(2, name="a.v1", run_after=now - timedelta(seconds=30))
        JobFactory(name="gone.v1")
        JobFactory(name="a.v1", running=True)

        Gauges(["a.v1", "idle.v1"]).run_once()

        assert sample("jobs_backlog", job_type="a.v1", supported="true") == 2
        assert sample("jobs_backlog", job_type="idle.v1", supported="true") == 0
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") == 1
        waited = sample("jobs_backlog_oldest_due_seconds", job_type="a.v1")
        assert waited is not None and 29 <= waited < 120
        assert sample("jobs_backlog_oldest_due_seconds", job_type="idle.v1") == 0

    def test_a_type_whose_jobs_are_gone_is_withdrawn_unless_registered(self):
        gone = JobFactory(name="gone.v1")
        gauges = Gauges(["a.v1"])
        gauges.run_once()
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") == 1

        Job.objects.filter(pk=gone.pk).delete()
        gauges.run_once()

        assert sample("jobs_backlog", job_type="gone.v1", supported="false") is None
        assert sample("jobs_backlog", job_type="a.v1", supported="true") == 0

    def test_unsupported_names_are_logged_when_their_count_changes(self, caplog):
        JobFactory(name="gone.v1")
        gauges = Gauges(["a.v1"])

        with caplog.at_level(logging.WARNING, logger="jobs.scheduler"):
            gauges.run_once()
            gauges.run_once()  # unchanged: not logged again
            JobFactory(name="gone.v1")
            gauges.run_once()

        warnings = [r for r in caplog.records if r.getMessage().startswith("unsupported")]
        assert [r.getMessage() for r in warnings] == [
            "unsupported job types remain outstanding: gone.v1 (1)",
            "unsupported job types remain outstanding: gone.v1 (2)",
        ]
        assert warnings[-1].action == "unsupported_backlog" and warnings[-1].count == 2

    def test_a_failing_count_is_reported_and_table_health_still_exported(self, monkeypatch, caplog):
        def broken(**kwargs):
            raise RuntimeError("backlog unavailable")

        monkeypatch.setattr(queue, "backlog", broken)
        counts = Gauges(["a.v1"]).run_once()

        assert counts["errors"] == 1
        assert "gauges: the backlog count failed" in caplog.text
        assert sample("jobs_table_size_bytes", table="jobs_job") > 0


class TestTableHealth:
    def test_sizes_of_the_table_and_each_index(self):
        JobFactory.create_batch(5)

        Gauges([]).run_once()

        assert sample("jobs_table_size_bytes", table="jobs_job") > 0
        for index in ("jobs_job_pkey", "jobs_job_claim", "jobs_job_running"):
            assert sample("jobs_table_index_size_bytes", table="jobs_job", index=index) > 0

    def test_dead_tuples_climb_with_churn_and_vacuum_clears_them(self):
        JobFactory.create_batch(50, succeeded=True)
        Job.objects.all().delete()
        gauges = Gauges([])

        def dead() -> float:
            gauges.run_once()
            return (sample("jobs_table_dead_tuples", table="jobs_job") or 0) >= 50

        wait_for(
            dead, what="50 dead tuples counted", interval=0.05
        )  # statistics are flushed ~1 s late
        with connection.cursor() as cur:
            cur.execute("VACUUM jobs_job")

        def vacuumed() -> float:
            gauges.run_once()
            return sample("jobs_table_dead_tuples", table="jobs_job") == 0

        wait_for(vacuumed, what="vacuum cleared the dead tuples", interval=0.05)
        assert sample("jobs_table_live_tuples", table="jobs_job") == 0
        # a manual VACUUM is not an autovacuum: still never autovacuumed in this database
        assert sample("jobs_table_last_autovacuum_timestamp_seconds", table="jobs_job") >= 0

    def test_the_statement_reads_only_catalogs(self):
        health = queue.table_health()

        assert health.table == "jobs_job"
        assert set(health.index_bytes) >= {"jobs_job_pkey", "jobs_job_claim"}
        assert health.table_bytes >= 0 and health.live_tuples >= 0


@pytest.fixture
def leaderships():
    made: list[Leadership] = []

    def make(identity: str) -> Leadership:
        leadership = Leadership(identity, key=KEY)
        made.append(leadership)
        return leadership

    yield make
    for leadership in made:
        leadership.release()


def scheduler(leadership: Leadership) -> Scheduler:
    config = SchedulerConfig(identity=leadership.identity, install_signal_handlers=False)
    return Scheduler(config, schedules=[], registry=get_registry(), leadership=leadership)


class TestLeaderOnly:
    def test_the_leader_exports_the_gauges_and_a_standby_none(self, leaderships):
        JobFactory(name="gone.v1")
        holder = leaderships("holder")
        assert holder.try_acquire()

        standby = scheduler(leaderships("standby"))
        standby.run(until=lambda s: True)
        assert not standby.leadership.leading
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") is None
        assert sample("jobs_table_size_bytes", table="jobs_job") is None

        holder.release()
        leader = scheduler(leaderships("leader"))
        leader.run(until=lambda s: s.passes >= 1)
        assert leader.last_pass.get("gauges")
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") == 1
        assert sample("jobs_table_size_bytes", table="jobs_job") > 0

    def test_a_leader_that_stands_by_withdraws_its_gauges(self, leaderships):
        JobFactory(name="gone.v1")
        first = scheduler(leaderships("first"))
        first.run(until=lambda s: s.passes >= 1)
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") == 1

        other = leaderships("other")
        assert other.try_acquire()  # first released on exit; now someone else leads
        first.run(until=lambda s: True)

        assert not first.leadership.leading
        assert sample("jobs_backlog", job_type="gone.v1", supported="false") is None
        assert sample("jobs_table_dead_tuples", table="jobs_job") is None
