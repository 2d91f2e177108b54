"""Real ``runworker`` processes whose DATABASE_URL points at PgBouncer in transaction mode.

Two workers drain a few thousand jobs, enqueued once both poll, through the pooler
(tests/support/pgbouncer.py: five server connections for everything, lent round robin); one is
killed with SIGKILL halfway, and the other takes its jobs back once their leases expire. Neither is
told ``--no-listen``: each finds that LISTEN delivers nothing there, says so once, and polls.
A trigger on the jobs table records every transition out of ``running``, so the database
itself says how many outcomes each job got. And workers killed with SIGKILL while their
listener decides whether to LISTEN leave no server connection of the pool listening.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request

import pytest
from django.db import connection
from django.db.models import Count

from jobs import enqueue_many
from jobs.models import Job
from tests.procapp.jobs import Trace
from tests.support.pgbouncer import (  # noqa: F401  (pgbouncer_fixture provides `pgbouncer`)
    PgBouncer,
    pgbouncer_fixture,
    skip_reason,
)
from tests.support.polling import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.acceptance,
    pytest.mark.slow,
    pytest.mark.once,
]

LOAD = 3000
LEASE = 2.0
HANDLER_SECONDS = 0.005  # 3,000 jobs on 2 x 4 slots: at least 1.9 s of draining
WORKER = [
    *("runworker", "--concurrency", "8", "--poll-interval", "0.2"),
    *("--maintenance-interval", "0.5", "--shutdown-timeout", "5", "--http-port", "0"),
]


def succeeded() -> int:
    return Job.objects.filter(state="succeeded").count()


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body = response.read().decode()
    return float(re.search(rf"^{name} (\S+)$", body, re.MULTILINE).group(1))


def test_workers_through_pgbouncer_lose_no_job_and_double_none(
    pgbouncer, outcome_log, spawn, tmp_path
):
    trace = tmp_path / "trace"
    env = {"DATABASE_URL": pgbouncer.database_url()}
    a = spawn(*WORKER, lease=LEASE, **env)
    b = spawn(*WORKER, lease=LEASE, **env)
    ports = {}
    for worker in (a, b):
        found = worker.wait_for_output(r"/metrics on 127\.0\.0\.1:(\d+)")
        ports[worker] = int(found.group(1))
        worker.wait_for_output(r"LISTEN delivers no notifications")
        identity = worker.wait_for_output(r"worker (\S+) started").group(1)
        worker.identity = identity
    assert metric(ports[a], "jobs_worker_listening") == 0
    # The load comes once both workers poll: enqueued before, it was drained while they were
    # still finding out that LISTEN is deaf here. Each handler takes a few milliseconds, so the
    # drain lasts seconds however fast the machine is, and b is caught holding jobs.
    with pgbouncer.routing():  # enqueue through the pooler too: one statement for them all
        load = enqueue_many([Trace(path=str(trace), seconds=HANDLER_SECONDS) for _ in range(LOAD)])
    started = time.monotonic()

    wait_for(lambda: succeeded() >= LOAD // 3, timeout=60, what="a third of the load done")
    assert b.proc.poll() is None, "worker b exited before it was to be killed"
    try:
        wait_for(
            lambda: Job.objects.filter(state="running", claimed_by=b.identity).exists(),
            what="worker b holds jobs",
            timeout=20,
        )
    except AssertionError as missed:
        states = dict(Job.objects.order_by().values_list("state").annotate(Count("id")))
        exit_code = b.proc.poll()
        raise AssertionError(
            f"{missed}; jobs by state {states}, b's exit code {exit_code}"
        ) from None
    b.proc.kill()
    b.wait()
    held = set(
        Job.objects.filter(state="running", claimed_by=b.identity).values_list("id", flat=True)
    )
    assert held

    wait_for(lambda: succeeded() == LOAD, timeout=90, what="every job succeeded")
    drained = time.monotonic() - started
    a.signal(signal.SIGTERM)
    assert a.wait(20) == 0

    # No job lost, none with two outcomes: each ended succeeded, by exactly one transition,
    # and taken back (an expired lease) only from the killed worker.
    with connection.cursor() as cur:
        cur.execute(
            "SELECT job, array_agg(state ORDER BY at), array_agg(worker ORDER BY at) "
            "FROM test_outcomes GROUP BY job"
        )
        transitions = {job: (states, workers) for job, states, workers in cur.fetchall()}
    assert set(transitions) == {job.id for job in load}
    assert all(states.count("succeeded") == 1 for states, _ in transitions.values())
    assert all(states[-1] == "succeeded" for states, _ in transitions.values())
    requeued_from = {w for _, workers in transitions.values() for w in workers[:-1]}
    assert requeued_from <= {b.identity}, requeued_from
    # What b held when it died was taken back, or finished by b's last statement (already on
    # its way to the server when b was killed, so it committed all the same).
    taken_back = {job for job, (states, _) in transitions.items() if len(states) > 1}
    finished_by_b = {job for job, (_, workers) in transitions.items() if workers == [b.identity]}
    assert taken_back and held <= taken_back | finished_by_b
    assert all(transitions[job][0][0] == "queued" for job in taken_back)
    # Each claim is one attempt, ended by one transition; a handler runs only on a claim (the
    # killed worker's last claims may not have started theirs).
    attempts = dict(Job.objects.values_list("id", "attempts"))
    assert all(attempts[job] == len(states) for job, (states, _) in transitions.items())
    starts = sum(1 for line in trace.read_text().splitlines() if line.startswith("start "))
    assert LOAD <= starts <= sum(attempts.values())
    for worker in (a, b):
        assert len(re.findall(r"LISTEN delivers no notifications", worker.output())) == 1
    assert "Traceback" not in a.output()
    assert pgbouncer.leftovers() == {}
    print(f"drained {LOAD} jobs through PgBouncer in {drained:.1f}s, {len(taken_back)} taken back")


def _pooler_clients(pooler: PgBouncer, application_name: str) -> list[dict]:
    return [
        client
        for client in pooler.show("CLIENTS")
        if client.get("application_name") == application_name
    ]


def _kill_while_proving(pooler: PgBouncer, spawn) -> None:
    """Start a worker through ``pooler`` and ``kill -9`` it at two moments of its proof.

    As its listener connects, and once its proof is under way (the probe's connection is at
    the pooler); or, either time, as soon as it has decided (the warning is out), as the
    decision may come first. Whatever it sent by then must leave no pooled server connection
    listening, nor anything else of a session.
    """
    env = {"DATABASE_URL": pooler.database_url()}
    moments = {
        "the listener connects": "jobs-worker listener",
        "the proof is under way": "jobs-worker listener probe",
    }
    for moment, client in moments.items():
        worker = spawn(*WORKER, **env)
        wait_for(
            lambda w=worker, c=client: (
                _pooler_clients(pooler, c) or "LISTEN delivers no notifications" in w.output()
            ),
            timeout=30,
            interval=0.005,
            what=f"{moment}, or the decision",
        )
        worker.proc.kill()
        worker.wait()
        wait_for(
            lambda: not _pooler_clients(pooler, "jobs-worker listener"),
            what="the killed listener's client gone",
            timeout=20,
        )
        assert pooler.leftovers() == {}, f"killed as {moment}"
    # No notice ever reached a server connection that no client held.
    assert "when not linked" not in pooler.log_text()


def test_a_worker_killed_while_it_proves_listen_leaves_nothing_on_the_pool(pgbouncer, spawn):
    """Round robin: the listener's transactions move between servers at once."""
    _kill_while_proving(pgbouncer, spawn)


def test_killed_while_proving_listen_behind_a_pooler_that_lends_the_last_server_first(spawn):
    """PgBouncer's default order, where an idle client's transactions stay on one backend:
    the proof then lasts until its probe times out, seconds in which the process may die.
    """
    if skip_reason():
        pytest.skip(skip_reason())
    with PgBouncer(round_robin=False) as lifo:
        _kill_while_proving(lifo, spawn)
