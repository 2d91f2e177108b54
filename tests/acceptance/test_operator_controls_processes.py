"""Pause, resume and cancel against real ``runworker`` processes."""

from __future__ import annotations

import time

import pytest

from jobs import enqueue, queue
from jobs.models import Job
from jobs.queue import attempts
from tests.procapp.jobs import RetryTrace, Trace
from tests.support.polling import wait_for
from tests.support.processes import read_trace

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

POLL = 0.2
FAST = ["--poll-interval", str(POLL), "--maintenance-interval", "0.2"]


def states(ids) -> dict[str, int]:
    counts: dict[str, int] = {}
    for state in Job.objects.filter(pk__in=ids).values_list("state", flat=True):
        counts[state] = counts.get(state, 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["queue", "tenant"])
def test_a_paused_queue_or_tenant_waits_on_every_worker_while_the_rest_runs(spawn, tmp_path, kind):
    path = tmp_path / "trace"
    workers = [spawn("runworker", *FAST, "--concurrency", "4") for _ in range(2)]
    for worker in workers:
        worker.wait_for_output("worker .* started")
    queue.pause(kind, "held", by="test")
    held = [enqueue(Trace(path=str(path)), **{kind: "held"}).id for _ in range(20)]
    free = [enqueue(Trace(path=str(path))).id for _ in range(40)]

    # The workers go on claiming: everything else runs, past the paused jobs.
    wait_for(lambda: states(free).get("succeeded") == 40, timeout=20, what="the free jobs ran")
    assert states(held) == {"queued": 20}
    assert len(read_trace(path)) == 2 * 40

    queue.resume(kind, "held")
    wait_for(lambda: states(held).get("succeeded") == 20, timeout=10, what="the held jobs ran")
    pids = {line[1] for line in read_trace(path) if line[0] == "start"}
    assert len(pids) == 2, "both workers took part"


def test_a_paused_job_type_waits_and_its_resume_wakes_idle_workers(spawn, tmp_path):
    path, retries = tmp_path / "trace", tmp_path / "retries"
    # A 30 s poll: only the resume's NOTIFY can wake an idle worker sooner.
    workers = [spawn("runworker", "--poll-interval", "30") for _ in range(2)]
    for worker in workers:
        worker.wait_for_output("worker .* started")
    queue.pause("job_type", Trace.job_name, by="test")
    held = [enqueue(Trace(path=str(path))).id for _ in range(10)]
    # Another type's retries show the workers claiming while the paused type waits.
    enqueue(RetryTrace(path=str(retries), seconds=0.05))
    wait_for(lambda: len(read_trace(retries)) == 3, timeout=20, what="three attempts elsewhere")
    assert states(held) == {"queued": 10}

    resumed = time.monotonic()
    queue.resume("job_type", Trace.job_name)
    wait_for(lambda: states(held).get("succeeded") == 10, timeout=10, what="the held jobs ran")
    assert time.monotonic() - resumed < 5


def test_cancel_of_a_running_job_stops_it_and_ends_it_cancelled(spawn, tmp_path):
    path = tmp_path / "trace"
    spawn("runworker", *FAST, lease=1.5)
    job = enqueue(Trace(path=str(path), seconds=60))
    wait_for(lambda: read_trace(path), what="the handler started", timeout=20)

    asked = time.monotonic()
    assert queue.cancel_running([job.id], by="alice") == [job.id]
    wait_for(lambda: Job.objects.get(pk=job.id).state == "cancelled", timeout=10)

    # Learned at the next renewal (a third of the lease), then one outcome write.
    assert time.monotonic() - asked < 1.5
    row = Job.objects.get(pk=job.id)
    assert (row.attempts, row.last_error) == (1, "cancelled")
    assert row.error_detail == "cancelled while running, asked by alice"
    assert [a.outcome for a in attempts.of(row)] == ["cancelled"]
    # The handler saw its flag and returned early.
    assert read_trace(path)[-1][0::3] == ["end", "cancelled"]


def test_cancel_of_a_job_on_a_killed_worker_ends_it_cancelled_not_retried(spawn, tmp_path):
    path = tmp_path / "trace"
    worker = spawn("runworker", *FAST, lease=1.0)
    job = enqueue(Trace(path=str(path), seconds=60))
    wait_for(lambda: read_trace(path), what="the handler started", timeout=20)
    worker.proc.kill()
    worker.wait()
    queue.cancel_running([job.id], by="alice")

    spawn("runworker", *FAST, lease=1.0)  # its maintenance pass finds the expired lease
    wait_for(lambda: Job.objects.get(pk=job.id).state == "cancelled", timeout=15)

    row = Job.objects.get(pk=job.id)
    assert row.attempts == 1 and len(read_trace(path)) == 1  # never ran again
    assert [(a.outcome, a.worker) for a in attempts.of(row)] == [("cancelled", row.claimed_by)]
    assert row.claimed_by
