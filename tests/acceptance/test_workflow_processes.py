"""Batches under real ``runworker`` processes: members finishing together, a killed finisher."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import Batch, JobSpec, batch
from jobs.models import Job
from tests.procapp.jobs import BatchReport, GateMember
from tests.support.polling import wait_for
from tests.support.processes import read_trace

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

FAST = ["--poll-interval", "0.05", "--maintenance-interval", "0.2"]


def runs(path) -> list[list[str]]:
    return [line for line in read_trace(path) if line[0] == "run"]


def test_members_finishing_at_the_same_instant_on_two_workers_fire_once(spawn, tmp_path):
    gate, report = tmp_path / "gate", tmp_path / "report"
    with batch(successor=BatchReport(path=str(report))) as group:
        group.enqueue_many(
            [GateMember(gate=str(gate), fail=i % 5 == 0) for i in range(40)],
        )
    spawn("runworker", *FAST, "--concurrency", "20")
    spawn("runworker", *FAST, "--concurrency", "20")
    wait_for(
        lambda: Job.objects.filter(name=GateMember.job_name, state="running").count() == 40,
        what="all 40 members running at once",
        timeout=20,
    )
    gate.touch()  # every member returns now, on both workers
    wait_for(lambda: runs(report), what="the successor ran", timeout=20)
    state = Batch(group.id).state()
    assert (state.total, state.succeeded, state.failed, state.cancelled) == (40, 32, 8, 0)
    wait_for(
        lambda: Job.objects.filter(name=BatchReport.job_name, state="succeeded").exists(),
        timeout=20,
    )
    assert Job.objects.filter(name=BatchReport.job_name).count() == 1
    [[_run, _pid, total, succeeded, failed, cancelled, listed]] = runs(report)
    assert (total, succeeded, failed, cancelled, listed) == ("40", "32", "8", "0", "8")


def _hold_key(tenant: str, job_id: str, held: threading.Event, release: threading.Event):
    """In another session: take the successor's key and keep the transaction open."""
    try:
        with transaction.atomic():
            Job.objects.create(
                job_id=job_id,
                tenant=tenant,
                name="test.blocker.v1",
                state="cancelled",
                key_held=True,
                finished_at=timezone.now(),
            )
            held.set()
            release.wait(30)
            transaction.set_rollback(True)
    finally:
        connection.close()


def _waiting_backends() -> list[int]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query ILIKE '%%jobs_job%%'"
        )
        return [pid for (pid,) in cur.fetchall()]


@pytest.mark.parametrize("server_noticed", [True, False], ids=["aborted", "completed"])
def test_a_worker_killed_between_the_members_outcome_and_the_successor(
    spawn, tmp_path, server_noticed
):
    """The last member's outcome and the successor's insert are one transaction.

    The test holds the successor's key in an open transaction, so the worker's outcome
    statement stops inside it: the member's state written, the batch counted, the successor
    not yet inserted. Then the worker is killed with SIGKILL. Either the server notices and
    aborts the statement (``aborted``: nothing of it stays, the lease expires and another
    worker runs the member again) or it finishes it when the key is let go (``completed``:
    the outcome and the successor commit together). Both ways the successor exists once.
    """
    gate, report = tmp_path / "gate", tmp_path / "report"
    gate.touch()
    with batch(
        successor=JobSpec(payload=BatchReport(path=str(report)), job_id="report-1")
    ) as group:
        [member] = group.enqueue_many([GateMember(gate=str(gate))])
    held, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=_hold_key, args=("default", "report-1", held, release))
    blocker.start()
    try:
        assert held.wait(10)
        first = spawn("runworker", *FAST, lease=1.0)
        [backend] = wait_for(
            _waiting_backends, what="the outcome statement waiting on the key", timeout=20
        )
        first.proc.kill()
        first.wait()
        if server_noticed:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(%s)", [backend])
            wait_for(lambda: not _waiting_backends(), what="the statement aborted", timeout=20)
            assert Job.objects.get(pk=member.id).state == "running"
            assert Batch(group.id).state().finished == 0
    finally:
        release.set()
        blocker.join(10)
    spawn("runworker", *FAST, lease=1.0)
    wait_for(lambda: runs(report), what="the successor ran", timeout=20)
    wait_for(lambda: Job.objects.filter(job_id="report-1", state="succeeded").exists(), timeout=20)
    row = Job.objects.get(pk=member.id)
    assert row.state == "succeeded"
    assert row.attempts == (2 if server_noticed else 1)
    assert Job.objects.filter(job_id="report-1").count() == 1
    assert [line[2:] for line in runs(report)] == [["1", "1", "0", "0", "0"]]
    state = Batch(group.id).state()
    assert (state.finished, state.total) == (1, 1)
