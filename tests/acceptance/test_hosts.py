"""Worker hosts in network namespaces of their own: one killed, one cut off, nothing lost.

Three ``runworker`` processes run as hosts ``host-a``, ``host-b`` and ``host-c``
(:mod:`tests.support.netns`): each in its own network namespace and hostname, reaching PostgreSQL
over a veth link through a TCP forwarder in this namespace (the embedded server listens on a Unix
socket only, and is shared with other test runs, so it is not restarted to listen on the links).
Under a load of thousands of jobs ``host-b`` is killed with SIGKILL and ``host-c``'s link is cut, so
that its connections hang rather than fail, until its leases have expired and its jobs run
elsewhere; then the link comes back. A trigger on the jobs table records every transition out of
``running``, so the database itself says how many outcomes each job got.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

from jobs import enqueue_many
from jobs.models import Job
from jobs.queue import processes
from tests.procapp.jobs import HostWork
from tests.support import netns
from tests.support.polling import wait_for
from tests.support.processes import ROOT
from tests.support.tcp_proxy import TcpProxy

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.acceptance,
    pytest.mark.slow,
    pytest.mark.once,
]

LEASE = 2.0  # seconds; every third of it the hosts renew, and beat in the processes view
NETWORK_TIMEOUT = 2.0  # JOBS["DB_NETWORK_TIMEOUT"]: how long a call on a dead path may hang
LOAD, SECOND_WAVE = 3000, 1000
WORKER = [
    *("runworker", "--concurrency", "10", "--poll-interval", "0.1"),
    *("--maintenance-interval", "0.5", "--shutdown-timeout", "2"),
]


class HostWorker:
    """A ``runworker`` process inside a host, its output in a file."""

    def __init__(self, host: netns.Host, proxy: TcpProxy, log: Path) -> None:
        self.host, self.proxy, self.log = host, proxy, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.identity = ""

    def start(self) -> None:
        env = {
            **os.environ,
            "DATABASE_URL": self.proxy.database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "TEST_JOBS_LEASE": str(LEASE),
            "TEST_JOBS_NETWORK_TIMEOUT": str(NETWORK_TIMEOUT),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "INFO",
        }
        with open(self.log, "w") as out:  # the child has its own copy of the descriptor
            command = self.host.command([sys.executable, str(ROOT / "manage.py"), *WORKER])
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)

    def wait_started(self) -> str:
        """This worker's identity, once its row is live in the processes view."""
        found = wait_for(
            lambda: re.search(r"worker (\S+) started", self.output()),
            what=f"{self.host.name} up",
            timeout=20,
        )
        self.identity = found.group(1)
        wait_for(
            lambda: self.status() and not self.status().gone,
            what=f"{self.host.name} row",
            timeout=20,
        )
        return self.identity

    def status(self) -> processes.ProcessStatus | None:
        rows = processes.status(self.identity, with_jobs=False)
        return rows[0] if rows else None

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def hosts(tmp_path):
    """Three hosts with a worker each (not started), torn down whatever happens."""
    if reason := netns.unavailable():
        pytest.skip(f"no worker hosts in network namespaces: {reason}")
    netns.remove_orphans()
    made: list[tuple[netns.Host, TcpProxy, HostWorker]] = []
    try:
        for index, name in enumerate(("host-a", "host-b", "host-c")):
            host = netns.Host(name, index).create()
            proxy = TcpProxy(host=host.near)
            made.append((host, proxy, HostWorker(host, proxy, tmp_path / f"{name}.log")))
        yield [worker for _, _, worker in made]
    finally:
        for host, proxy, worker in made:
            worker.stop()
            proxy.close()
            host.destroy()


# outcome_log comes first so that it is torn down last: dropping its trigger waits for every
# session that holds a lock on the jobs table, and a session the cut left half-sent through a
# host's proxy holds one until the hosts are torn down.
def test_hosts_lose_no_job_and_double_none_through_a_kill_and_a_cut(outcome_log, hosts, tmp_path):
    a, b, c = hosts
    trace, gate = tmp_path / "trace", tmp_path / "gate"
    took: dict[str, float] = {}  # seconds, as measured (printed at the end)

    # host-c first, alone: it takes the jobs it will hold when its link is cut. Two wait for
    # the gate (opened once the link is down: they return with nowhere to report), two run
    # until they are cancelled.
    c.start()
    c.wait_started()
    late = enqueue_many([HostWork(path=str(trace), first_seconds=120, gate=str(gate))] * 2)
    stuck = enqueue_many([HostWork(path=str(trace), first_seconds=120)] * 2)
    held = {job.job_id for job in late + stuck}
    wait_for(
        lambda: {r.job for r in runs(trace, "start", "host-c")} >= held, what="c holds", timeout=20
    )
    a.start()
    b.start()
    a.wait_started()
    b.wait_started()
    view = {row.identity: row for row in processes.status(with_jobs=False)}
    assert {view[w.identity].host for w in hosts} == {"host-a", "host-b", "host-c"}
    assert all(view[w.identity].pid == w.proc.pid for w in hosts)
    assert all(w.identity.startswith(f"{w.host.name}:{w.proc.pid}:") for w in hosts)
    c_registered = view[c.identity].started_at

    started = time.monotonic()
    load = enqueue_many([HostWork(path=str(trace), seconds=0.01) for _ in range(LOAD)])
    wait_for(lambda: succeeded() >= LOAD // 4, timeout=30, what="a quarter of the load done")

    # host-b dies holding jobs.
    wait_for(lambda: held_by(b.identity), what="host-b holds jobs", timeout=20)
    b.proc.kill()
    b.proc.wait(10)
    b_held = held_by(b.identity)
    assert b_held

    # host-c is cut off: its open connections hang. Then its gated handlers return.
    wait_for(lambda: succeeded() >= LOAD // 2, timeout=30, what="half the load done")
    c.host.cut()
    cut = time.monotonic()
    gate.touch()
    wait_for(lambda: c.status().gone, what="host-c shown gone", timeout=20)
    took["shown gone"] = time.monotonic() - cut
    wait_for(lambda: not held_by(c.identity), timeout=30, what="host-c's jobs taken back")
    took["jobs taken back"] = time.monotonic() - cut
    stopped = {job.job_id for job in stuck}
    wait_for(lambda: {r.job for r in ended(trace, "cancelled")} >= stopped, timeout=30)
    wait_for(lambda: succeeded(held) == len(held), timeout=30, what="its held jobs ran elsewhere")
    states = {row.host: row.state for row in processes.status(with_jobs=False)}
    assert states == {"host-a": "ready", "host-b": "gone", "host-c": "gone"}, states

    c.host.restore()
    restored = time.monotonic()
    for job_id in {job.job_id for job in late}:
        c_log = re.escape(f"outcome of job {job_id} (test.host_work.v1) discarded")
        wait_for(lambda j=c_log: re.search(j, c.output()), timeout=30, what="late outcome fenced")
    took["late outcomes fenced"] = time.monotonic() - restored
    wait_for(lambda: not c.status().gone, timeout=30, what="host-c shown live again")
    took["shown live"] = time.monotonic() - restored

    wave = enqueue_many([HostWork(path=str(trace), seconds=0.01) for _ in range(SECOND_WAVE)])
    everything = {job.id for job in late + stuck + load + wave}
    wait_for(lambda: succeeded() == len(everything), timeout=60, what="every job succeeded")
    took["all done"] = time.monotonic() - started
    # host-c rejoined without a restart: the same process, registered once, took new work.
    back = c.status()
    assert (back.pid, back.started_at, back.gone) == (c.proc.pid, c_registered, False)
    by_id = {job.id: job for job in Job.objects.filter(id__in=everything)}
    finished_by_c = sum(1 for job in wave if by_id[job.id].claimed_by == c.identity)
    assert finished_by_c > 0
    for worker in (a, c):
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(15) == 0

    # No job lost, none with two outcomes: each ended succeeded, by exactly one transition.
    transitions = recorded_transitions()
    assert set(transitions) == everything
    assert all(states.count("succeeded") == 1 for states, _ in transitions.values())
    assert all(states[-1] == "succeeded" for states, _ in transitions.values())
    # Taken back (an expired lease) only from the killed and the cut host, never from host-a.
    requeued_from = {w for states, workers in transitions.values() for w in workers[:-1]}
    assert requeued_from <= {b.identity, c.identity}, requeued_from
    # host-b's jobs ran again elsewhere (a statement it sent as it died may still have landed).
    b_runs = [transitions[job.id] for job in b_held]
    assert all(workers[0] == b.identity for _, workers in b_runs)
    assert any(len(states) > 1 and workers[-1] != b.identity for states, workers in b_runs)

    # host-c's late outcomes were fenced, its other handlers cancelled while it was cut off.
    for job in late + stuck:
        assert transitions[job.id][1][0] == c.identity  # taken back from host-c ...
        assert by_id[job.id].claimed_by != c.identity  # ... and finished by another host
    c_ended = {r.job: r for r in ended(trace) if r.host == "host-c" and r.attempt == 1}
    assert all(c_ended[job.job_id].status == "ok" for job in late)
    assert all(c_ended[job_id].status == "cancelled" for job_id in stopped)
    took["handlers cancelled"] = max(c_ended[job_id].at for job_id in stopped) - cut
    # Told to stop once their leases may have ended (the cut came at most a lease after the
    # last renewal), not only when a renewal hanging on the dead link gives up.
    assert took["handlers cancelled"] < LEASE + 1.0, took
    assert "lost the lease of job" in c.output()
    for worker in hosts:  # each host's log names it
        assert f"worker {worker.host.name}:{worker.proc.pid}:" in worker.output()

    print(
        f"\n{len(everything)} jobs on 3 hosts (lease {LEASE:g}s, network timeout "
        f"{NETWORK_TIMEOUT:g}s), host-b killed holding {len(b_held)} jobs, host-c cut off "
        f"{restored - cut:.1f}s; after the cut: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in took.items() if k in CUT_FIGURES)
        + "; after the link came back: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in took.items() if k in BACK_FIGURES)
        + f"; host-c finished {finished_by_c} of the {SECOND_WAVE} jobs enqueued then; "
        f"all done {took['all done']:.1f}s after the load began"
    )


CUT_FIGURES = ("shown gone", "jobs taken back", "handlers cancelled")
BACK_FIGURES = ("late outcomes fenced", "shown live")


def recorded_transitions() -> dict[int, tuple[list[str], list[str]]]:
    """Each job's transitions out of ``running``, oldest first: (new states, holders)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT job, array_agg(state ORDER BY at), array_agg(worker ORDER BY at) "
            "FROM test_outcomes GROUP BY job"
        )
        return {job: (states, workers) for job, states, workers in cur.fetchall()}


class Run:
    """A line of the handlers' trace: ``start|end host pid job_id attempt time [status]``."""

    def __init__(self, line: str) -> None:
        kind, self.host, pid, self.job, attempt, at, *status = line.split()
        self.kind, self.pid, self.attempt, self.at = kind, int(pid), int(attempt), float(at)
        self.status = status[0] if status else ""


def runs(trace: Path, kind: str, host: str | None = None) -> list[Run]:
    if not trace.exists():
        return []
    lines = trace.read_text().split("\n")[:-1]  # not a line still being written
    found = [Run(line) for line in lines if line.startswith(kind + " ")]
    return [run for run in found if host is None or run.host == host]


def ended(trace: Path, status: str | None = None) -> list[Run]:
    return [run for run in runs(trace, "end") if status is None or run.status == status]


def succeeded(job_ids: set[str] | None = None) -> int:
    jobs = Job.objects.filter(state="succeeded")
    return (jobs if job_ids is None else jobs.filter(job_id__in=job_ids)).count()


def held_by(identity: str) -> list[Job]:
    return list(Job.objects.filter(state="running", claimed_by=identity))
