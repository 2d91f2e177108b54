"""Real ``runworker`` and ``runscheduler`` processes in the processes table (jobs_process).

A process registers at start and beats from statements it makes anyway, idle or busy; a
clean stop removes its row; ``kill -9`` leaves it, shown as gone once it expires (one lease
after the last beat) and deleted by the scheduler's retention pass.
"""

from __future__ import annotations

import signal

import pytest

from jobs import enqueue
from jobs.models import Job, Process
from jobs.queue import processes
from tests.procapp.jobs import Trace
from tests.support.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

FAST = ["--poll-interval", "0.1", "--maintenance-interval", "0.2"]


def row_of(process) -> processes.ProcessStatus | None:
    return next((row for row in processes.status() if row.pid == process.pid), None)


def beats_after(process, seen) -> bool:
    row = row_of(process)
    return row is not None and row.last_seen_at > seen


def test_a_worker_beats_idle_and_busy_drains_and_leaves_on_sigterm(spawn, tmp_path):
    worker = spawn("runworker", *FAST, "--concurrency", "3", "--shutdown-timeout", "1", lease=0.6)
    row = wait_for(lambda: row_of(worker), timeout=15, what="the worker registered")
    assert (row.component, row.concurrency, row.scope, row.state) == (
        "worker",
        3,
        "component worker",
        "ready",
    )
    assert f":{worker.pid}:" in row.identity
    assert (row.expires_at - row.last_seen_at).total_seconds() == pytest.approx(0.6)

    idle = row.last_seen_at
    wait_for(lambda: beats_after(worker, idle), timeout=5, what="an idle worker's beat")

    job = enqueue(Trace(path=str(tmp_path / "trace"), seconds=30))
    busy = wait_for(
        lambda: (r := row_of(worker)) and r.held == 1 and r.jobs and r, timeout=5, what="held"
    )
    assert [held.id for held in busy.jobs] == [job.id]
    assert Job.objects.get(pk=job.id).claimed_by == busy.identity
    assert busy.free == 2
    wait_for(lambda: beats_after(worker, busy.last_seen_at), timeout=5, what="a busy beat")

    worker.signal(signal.SIGTERM)  # the job outlives the shutdown timeout: handed back
    wait_for(lambda: (r := row_of(worker)) and r.state == "draining", timeout=5, what="draining")
    assert worker.wait(timeout=15) == 0
    assert not Process.objects.filter(pid=worker.pid).exists()
    assert Job.objects.get(pk=job.id).state == "queued"


def test_kill_9_leaves_a_row_that_goes_gone_then_retention_removes_it(spawn):
    worker = spawn("runworker", *FAST, lease=0.6)
    identity = wait_for(lambda: row_of(worker), timeout=15, what="registered").identity

    worker.proc.kill()  # SIGKILL: no clean stop
    worker.wait()
    assert row_of(worker) is not None, "nothing removed it"
    gone = wait_for(lambda: (r := row_of(worker)) and r.state == "gone" and r, timeout=5)
    assert gone.free == 0
    assert processes.capacity().workers == 0

    scheduler = spawn("runscheduler", "--once", TEST_JOBS_PROCESS_RETENTION="0.05")
    assert scheduler.wait(timeout=30) == 0, scheduler.output()
    assert not Process.objects.filter(identity=identity).exists()
    assert not Process.objects.exists(), "the --once scheduler removed its own row too"


def test_a_scheduler_registers_as_leader_and_leaves_on_sigterm(spawn):
    scheduler = spawn("runscheduler", "--tick-interval", "0.2", "--standby-interval", "0.2")
    row = wait_for(lambda: (r := row_of(scheduler)) and r.leader and r, timeout=15, what="leading")
    assert (row.component, row.concurrency, row.state) == ("scheduler", None, "ready")
    assert processes.capacity() == (0, 0, 0), "schedulers are not capacity"

    scheduler.signal(signal.SIGTERM)
    assert scheduler.wait(timeout=15) == 0
    assert not Process.objects.filter(pid=scheduler.pid).exists()
