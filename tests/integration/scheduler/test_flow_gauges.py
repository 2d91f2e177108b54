"""The gauges duty's flow gauges: running against the global limit, held-back due jobs, tokens,
throttles; per job type, never per tenant, exported by the leader alone like the backlog."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from jobs import queue
from jobs.admin.flow import controlled
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.runs import RunState
from jobs.scheduler import gauges as gauges_module
from jobs.scheduler.gauges import Gauges, held_back
from tests.support.flow import (
    FAIR,
    GATED,
    PER_TENANT,
    PLAIN,
    RATED,
    claim,
    enqueue,
    flow_registry,
    seed_limits_in_force,
)

pytestmark = pytest.mark.django_db(transaction=True)


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture(autouse=True)
def fresh_gauges():
    Gauges([], limits={}).withdraw()
    yield
    Gauges([], limits={}).withdraw()


@pytest.fixture
def registry():
    return flow_registry()


def duty(registry) -> Gauges:
    return Gauges(registry.names(), limits=controlled(registry))


def test_each_type_exports_running_its_limit_and_the_due_jobs_its_limits_hold_back(registry):
    seed_limits_in_force(registry)

    counts = duty(registry).run_once()

    assert counts["flow"] == 5 and not counts["errors"]
    assert sample("jobs_flow_running", job_type=GATED) == 2
    assert sample("jobs_flow_limit", job_type=GATED) == 2
    assert sample("jobs_flow_limited", job_type=GATED) == 3
    assert sample("jobs_flow_limited", job_type=RATED) == 2
    assert sample("jobs_flow_rate_tokens", job_type=RATED) < 1
    assert sample("jobs_flow_limited", job_type=FAIR) == 0  # due, with room
    assert sample("jobs_flow_limited", job_type=PER_TENANT) == 3  # acme's 2, bolt's 1
    assert sample("jobs_flow_running", job_type=PER_TENANT) == 2
    assert sample("jobs_flow_limited", job_type=PLAIN) == 4
    assert 590 < sample("jobs_flow_throttled_seconds", job_type=PLAIN) <= 600
    assert sample("jobs_flow_throttled_seconds", job_type=GATED) == 0
    # Only the types' own limits are exported: no global limit, no series.
    assert sample("jobs_flow_limit", job_type=FAIR) is None
    assert sample("jobs_flow_rate_tokens", job_type=GATED) is None


def test_held_back_jobs_go_when_the_limit_has_room_again(registry):
    seed_limits_in_force(registry)
    gauges = duty(registry)
    gauges.run_once()
    assert sample("jobs_flow_limited", job_type=GATED) == 3

    running = list(Job.objects.filter(name=GATED, state=RunState.RUNNING))
    Job.objects.filter(pk=running[0].pk).update(
        state=RunState.SUCCEEDED, finished_at=database_now()
    )
    gauges.run_once()

    assert sample("jobs_flow_running", job_type=GATED) == 1
    assert sample("jobs_flow_limited", job_type=GATED) == 0
    assert len(claim(registry, GATED)) == 1  # the claim agrees: one place was free
    gauges.run_once()
    assert sample("jobs_flow_limited", job_type=GATED) == 3 - 1


def test_a_type_throttled_only_is_withdrawn_once_its_throttle_ends(registry):
    queue.throttle(PLAIN, 600, reason="slow down")
    enqueue(PLAIN, 2)
    gauges = duty(registry)
    gauges.run_once()
    assert sample("jobs_flow_limited", job_type=PLAIN) == 2

    queue.throttle(PLAIN, 0.0)  # only lengthens: a throttle in force stays
    gauges.run_once()
    assert sample("jobs_flow_throttled_seconds", job_type=PLAIN) > 0
    queue.resume("job_type", PLAIN)  # an operator resumes it early
    gauges.run_once()

    assert sample("jobs_flow_running", job_type=PLAIN) is None
    assert sample("jobs_flow_throttled_seconds", job_type=PLAIN) is None
    assert sample("jobs_flow_running", job_type=GATED) == 0  # limited types stay, at 0


def test_an_operator_pause_holds_back_without_being_a_throttle(registry):
    seed_limits_in_force(registry)
    queue.pause("job_type", FAIR, by="alice", reason="INC-7")

    duty(registry).run_once()

    assert sample("jobs_flow_limited", job_type=FAIR) == 8
    assert sample("jobs_flow_throttled_seconds", job_type=FAIR) == 0


def test_the_limits_default_to_the_registrys_and_withdraw_clears_every_flow_gauge(
    registry, monkeypatch
):
    monkeypatch.setattr(gauges_module, "get_registry", lambda: registry)
    seed_limits_in_force(registry)
    gauges = Gauges(registry.names())
    assert set(gauges.limits) == {GATED, RATED, FAIR, PER_TENANT}
    gauges.run_once()
    assert sample("jobs_flow_running", job_type=GATED) == 2

    gauges.withdraw()

    for name in ("running", "limit", "limited", "rate_tokens", "throttled_seconds"):
        assert sample(f"jobs_flow_{name}", job_type=GATED) is None
        assert sample(f"jobs_flow_{name}", job_type=PLAIN) is None


def test_a_failing_flow_read_is_counted_and_the_rest_still_exported(registry, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("flow unavailable")

    monkeypatch.setattr(gauges_module.flow_state, "state", broken)
    enqueue(GATED, 1)

    counts = duty(registry).run_once()

    assert counts["errors"] == 1
    assert sample("jobs_backlog", job_type=GATED, supported="true") == 1
    assert sample("jobs_table_size_bytes", table="jobs_job") > 0


def test_nothing_due_is_nothing_held_back():
    now = database_now()
    assert held_back(None, None, now=now).jobs == 0
