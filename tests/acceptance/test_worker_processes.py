"""Crash, stall and shutdown behaviour of real ``runworker`` processes."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from django.db import connection

from jobs import enqueue
from jobs.models import Job
from tests.procapp.jobs import RetryTrace, Trace
from tests.support.polling import wait_for
from tests.support.processes import read_trace

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

FAST = ["--poll-interval", "0.1", "--maintenance-interval", "0.2"]


def job_row(enqueued) -> Job:
    return Job.objects.get(pk=enqueued.id)


def lease_expired(enqueued) -> bool:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT lease_expires_at < statement_timestamp() FROM jobs_job WHERE id = %s",
            [enqueued.id],
        )
        return bool(cur.fetchone()[0])


def starts(trace_path, pid=None) -> list[list[str]]:
    return [
        r for r in read_trace(trace_path) if r[0] == "start" and (pid is None or r[1] == str(pid))
    ]


def test_kill_9_mid_job_runs_the_job_again_elsewhere(spawn, tmp_path):
    path = tmp_path / "trace"
    job = enqueue(Trace(path=str(path), seconds=60))
    first = spawn("runworker", *FAST, lease=1.0)
    wait_for(lambda: starts(path, first.pid), what="first worker started the job", timeout=20)

    first.proc.kill()  # SIGKILL: no cleanup at all
    first.wait()
    assert job_row(job).state == "running"

    Job.objects.filter(pk=job.id).update(payload={"path": str(path), "seconds": 0.1})
    second = spawn("runworker", *FAST, lease=1.0)
    wait_for(
        lambda: job_row(job).state == "succeeded",
        what="job finished on the second worker",
        timeout=20,
    )

    done = job_row(job)
    assert done.attempts == 2
    assert done.result == second.pid
    assert [r[1] for r in starts(path)] == [str(first.pid), str(second.pid)]


@pytest.mark.parametrize("second_still_running", [False, True], ids=["after", "during"])
def test_sigstopped_worker_cannot_report_over_its_successor(spawn, tmp_path, second_still_running):
    path = tmp_path / "trace"
    job = enqueue(Trace(path=str(path), seconds=1.5, ignore_cancel=True))
    stale = spawn("runworker", *FAST, "--http-port", "0", lease=1.0)
    port = int(stale.wait_for_output(r"/metrics on 127\.0\.0\.1:(\d+)").group(1))
    wait_for(lambda: starts(path, stale.pid), what="stale worker started the job", timeout=20)
    stale.signal(signal.SIGSTOP)
    wait_for(lambda: lease_expired(job), what="the stalled worker's lease expired", timeout=20)

    successor_seconds = 30 if second_still_running else 0.1
    Job.objects.filter(pk=job.id).update(
        payload={"path": str(path), "seconds": successor_seconds, "ignore_cancel": True}
    )
    successor = spawn("runworker", *FAST, lease=5.0)
    if second_still_running:
        wait_for(lambda: starts(path, successor.pid), what="successor started the job", timeout=20)
    else:
        wait_for(
            lambda: job_row(job).state == "succeeded", what="successor finished the job", timeout=20
        )
    before = job_row(job)

    stale.signal(signal.SIGCONT)
    wait_for(lambda: _discarded(port) >= 1, what="stale worker discarded its outcome", timeout=20)

    after = job_row(job)
    assert (after.state, after.attempts, after.claim_token) == (
        before.state,
        before.attempts,
        before.claim_token,
    )
    assert after.attempts == 2
    assert after.state == ("running" if second_still_running else "succeeded")


def _discarded(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for metric in ("jobs_fenced_outcomes_total", "jobs_lost_leases_total"):
        for match in re.finditer(rf"^{metric}{{[^}}]*}} ([0-9.e+]+)$", body, re.M):
            total += float(match.group(1))
    return total


def test_sigterm_lets_a_short_job_finish_and_hands_a_long_one_back(spawn, tmp_path):
    short_path, long_path = tmp_path / "short", tmp_path / "long"
    short = enqueue(Trace(path=str(short_path), seconds=1.0))
    long = enqueue(Trace(path=str(long_path), seconds=60))
    worker = spawn("runworker", *FAST, "--shutdown-timeout", "3", "--http-port", "0")
    port = int(worker.wait_for_output(r"/metrics on 127\.0\.0\.1:(\d+)").group(1))
    wait_for(lambda: starts(short_path) and starts(long_path), what="both jobs started", timeout=20)

    worker.signal(signal.SIGTERM)
    wait_for(lambda: _status(port, "/readyz") == 503, what="not ready while draining", timeout=20)

    assert worker.wait(timeout=15) == 0
    assert job_row(short).state == "succeeded"
    handed_back = job_row(long)
    assert (handed_back.state, handed_back.attempts, handed_back.claim_token) == ("queued", 0, None)
    assert "its handler returned after being cancelled" in worker.output()


def test_drain_never_lets_two_handlers_run_one_job(spawn, tmp_path):
    # The handler ignores cancellation for 2 s: past the shutdown timeout, within the cancel
    # timeout. Its lease (1 s) must be renewed meanwhile, so the second worker, already
    # polling, cannot take the job until the handler returned and the job was handed back.
    path = tmp_path / "trace"
    job = enqueue(Trace(path=str(path), seconds=2.0, ignore_cancel=True))
    first = spawn(
        "runworker", *FAST, "--shutdown-timeout", "0.3", "--cancel-timeout", "5", lease=1.0
    )
    wait_for(lambda: starts(path, first.pid), what="first worker started the job", timeout=20)
    first.signal(signal.SIGTERM)
    second = spawn("runworker", *FAST, lease=1.0)

    wait_for(lambda: job_row(job).state == "succeeded", what="the job finished", timeout=30)
    assert first.wait(timeout=15) == 0
    lines = [(r[0], r[1]) for r in read_trace(path)]
    assert lines == [
        ("start", str(first.pid)),
        ("end", str(first.pid)),
        ("start", str(second.pid)),
        ("end", str(second.pid)),
    ]
    assert "its handler returned after being cancelled" in first.output()


def test_a_handler_still_running_at_exit_keeps_its_lease(spawn, tmp_path):
    path = tmp_path / "trace"
    job = enqueue(Trace(path=str(path), seconds=60, ignore_cancel=True))
    worker = spawn(
        "runworker", *FAST, "--shutdown-timeout", "0.3", "--cancel-timeout", "0.3", lease=30.0
    )
    wait_for(lambda: starts(path, worker.pid), what="the job started", timeout=20)

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0

    held = job_row(job)
    assert (held.state, held.attempts) == ("running", 1), "never released while it ran"
    assert f":{worker.pid}:" in held.claimed_by
    assert "1 handlers did not stop after cancellation" in worker.output()


def test_second_signal_stops_at_once_without_losing_the_job(spawn, tmp_path):
    path = tmp_path / "trace"
    job = enqueue(Trace(path=str(path), seconds=60))
    worker = spawn("runworker", *FAST, "--shutdown-timeout", "60")
    wait_for(lambda: starts(path), what="job started", timeout=20)

    worker.signal(signal.SIGTERM)
    worker.wait_for_output("draining")
    worker.signal(signal.SIGINT)

    assert worker.wait(timeout=10) == 0
    assert (job_row(job).state, job_row(job).attempts) == ("queued", 0)


def test_health_endpoints(spawn):
    worker = spawn("runworker", *FAST, "--http-port", "0")
    port = int(worker.wait_for_output(r"/metrics on 127\.0\.0\.1:(\d+)").group(1))
    wait_for(lambda: _status(port, "/readyz") == 200, what="ready", timeout=20)
    assert _status(port, "/healthz") == 200
    assert _status(port, "/nope") == 404
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "jobs_worker_ready 1.0" in body


def _status(port: int, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_kill_9_during_in_process_retries_never_exceeds_max_attempts(spawn, tmp_path):
    path = tmp_path / "trace"
    job = enqueue(RetryTrace(path=str(path), seconds=0.5))  # max_attempts = 3
    for _round in range(4):
        if job_row(job).state == "failed":
            break
        worker = spawn("runworker", *FAST, lease=1.0)
        wait_for(
            lambda w=worker: len(starts(path, w.pid)) >= 2 or job_row(job).state == "failed",
            what="two attempts in one claim, or the job failed",
            timeout=20,
        )
        worker.proc.kill()  # during the in-process wait after the second attempt
        worker.wait()

    assert len(starts(path)) <= 3, starts(path)
    wait_for(lambda: job_row(job).state == "failed", what="the job failed", timeout=10)
    assert job_row(job).attempts == 3


def test_database_outage_backs_off_without_spinning(spawn):
    worker = spawn("runworker", "--poll-interval", "0.1")
    worker.wait_for_output("started")
    name = connection.settings_dict["NAME"]
    connection.ensure_connection()  # this test's own session outlives the outage
    try:
        # The database goes away under an idle worker: no new connections, old ones cut.
        with connection._nodb_cursor() as cur:
            cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        with connection.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        cpu_before, started = _cpu_seconds(worker.pid), time.monotonic()
        wait_for(lambda: _retries(worker) >= 4, what="four retries", timeout=20)
        cpu, wall = _cpu_seconds(worker.pid) - cpu_before, time.monotonic() - started
        queued = enqueue(Trace(path="/dev/null"))
    finally:
        with connection._nodb_cursor() as cur:
            cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    # Waits of 0.1, 0.2, 0.4 s between the four failures: no spinning, near-idle CPU.
    assert wall >= 0.6
    assert cpu < 0.25 * wall, (cpu, wall)
    assert "Traceback" not in worker.output(), "one line per retry during an outage"
    wait_for(lambda: job_row(queued).state == "succeeded", what="work after the outage", timeout=20)


def _retries(process) -> int:
    return process.output().count("database error in the run loop")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
