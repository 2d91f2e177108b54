"""The worker's own metrics: handlers running, outcomes by type and kind, and histograms.

The gauge and the counters are kept without an update of a prometheus value per job: the
running gauge reads the workers' counts when scraped, and a pass adds its outcomes up before
counting them. The histograms are the worker's own (tests/unit/worker/test_histograms.py).
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from jobs import enqueue
from jobs.models import Job
from jobs.worker import metrics
from tests.support.polling import wait_for
from tests.support.worker import Recorder, Step, registry, running_worker

pytestmark = pytest.mark.django_db(transaction=True)

STEP = "test.step.v1"


def running_gauge() -> float:
    return REGISTRY.get_sample_value("jobs_worker_running")


def outcomes(kind: str) -> float:
    value = REGISTRY.get_sample_value("jobs_outcomes_total", {"job_type": STEP, "outcome": kind})
    return value or 0.0


def settled(jobs, state: str) -> bool:
    return Job.objects.filter(pk__in=[j.id for j in jobs], state=state).count() == len(jobs)


def test_the_running_gauge_counts_handlers_while_they_run(monkeypatch):
    updates: list[str] = []
    monkeypatch.setattr(metrics.running, "inc", lambda amount=1: updates.append("inc"))
    monkeypatch.setattr(metrics.running, "dec", lambda amount=1: updates.append("dec"))
    before = running_gauge()
    with running_worker(registry(Recorder(), concurrency=None), concurrency=3):
        load = [enqueue(Step(plan=("sleep",), seconds=0.5)) for _ in range(3)]
        wait_for(
            lambda: running_gauge() - before == 3,
            what="3 handlers counted as running",
            interval=0.005,
        )
        wait_for(lambda: settled(load, "succeeded"), what="every job succeeded", interval=0.005)
        wait_for(
            lambda: running_gauge() == before, what="the gauge back where it was", interval=0.005
        )
    assert updates == []  # no per-job update of the gauge


def observed(histogram: str) -> float:
    value = REGISTRY.get_sample_value(f"{histogram}_count", {"job_type": STEP})
    return value or 0.0


def test_outcomes_are_counted_by_kind():
    succeeded, retried, failed = outcomes("succeeded"), outcomes("retried"), outcomes("failed")
    calls = observed("jobs_handler_duration_seconds")
    claims = observed("jobs_queue_latency_seconds")
    with running_worker(registry(Recorder(), concurrency=None), concurrency=4):
        ok = [enqueue(Step(plan=("ok",))) for _ in range(7)]
        rejected = [enqueue(Step(plan=("reject",))) for _ in range(3)]
        flaky = [enqueue(Step(plan=("error", "ok"))) for _ in range(2)]
        wait_for(
            lambda: settled(ok + flaky, "succeeded"), what="the good jobs succeeded", interval=0.005
        )
        wait_for(
            lambda: settled(rejected, "failed"), what="the rejected jobs failed", interval=0.005
        )
    assert outcomes("succeeded") - succeeded == 9
    assert outcomes("retried") - retried == 2
    assert outcomes("failed") - failed == 3
    # 14 claims, each one handler call: 7 + 3 + 2 x 2 (the flaky ones run twice).
    assert observed("jobs_handler_duration_seconds") - calls == 14
    assert observed("jobs_queue_latency_seconds") - claims == 14


@pytest.mark.django_db(transaction=True)
def test_the_duration_histogram_exports_its_created_series():
    name = "metrics.created.v1"
    metrics.for_type(name).handler_duration.observe(0.2)
    labels = {"job_type": name}
    # The counters next to it still have theirs (prometheus_client's default)…
    assert REGISTRY.get_sample_value("jobs_claimed_created", labels) is not None
    # …and the library Histogram this replaced exported one for every job type.
    assert REGISTRY.get_sample_value("jobs_handler_duration_seconds_created", labels) is not None
