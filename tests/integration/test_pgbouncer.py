"""The queue, the worker and the admin through PgBouncer in transaction mode.

Each test takes the ``pgbouncer`` fixture (tests/support/pgbouncer.py): a private pooler whose few
server connections are lent round robin, so consecutive transactions of one client run on
different backends and anything that leans on session state breaks here. After the work,
every server connection of the pool is inspected: nothing may be left on one (a LISTEN, a
prepared statement, a session advisory lock, a temporary table, a ``SET`` without ``LOCAL``)
for the next client it is lent to.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client import REGISTRY

from jobs import enqueue, queue
from jobs.core.conf import DEFAULTS, NOTIFY_CHANNEL
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome
from jobs.worker import wakeup
from jobs.worker.config import WorkerConfig
from jobs.worker.maintenance import WorkerMaintenance
from jobs.worker.runner import Worker
from jobs.worker.wakeup import NotifyListener
from tests.support.factories import JobFactory
from tests.support.pgbouncer import PgBouncer, pgbouncer_fixture, skip_reason  # noqa: F401
from tests.support.polling import wait_for
from tests.support.tcp_proxy import TcpProxy
from tests.support.worker import Echo, Recorder, Step, registry

pytestmark = [pytest.mark.django_db(transaction=True)]

NOOP = "test.noop.v1"


def _backend(conn) -> int:
    return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def _listening_gauge() -> float | None:
    return REGISTRY.get_sample_value("jobs_worker_listening")


def _listener_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "jobs.worker" and getattr(r, "action", "") == "listen_unavailable"
    ]


# -- the fixture -----------------------------------------------------------------------------


def test_the_fixture_pools_by_transaction(pgbouncer):
    """Two consecutive transactions of one client land on different backends."""
    assert pgbouncer.pool_mode == "transaction"
    with pgbouncer.connect() as client, pgbouncer.connect() as other:
        with client.transaction():
            first = _backend(client)
        with other.transaction():  # holds a server, so the client's next one is another
            held = _backend(other)
            with client.transaction():
                second = _backend(client)
        assert first != second and second != held
        seen = set()
        for _ in range(2 * pgbouncer.pool_size):
            with client.transaction():
                seen.add(_backend(client))
    assert len(seen) > 1
    assert len(pgbouncer.session_state()) == pgbouncer.pool_size


def test_the_inspection_finds_what_a_session_leaves_behind(pgbouncer):
    """The check the other tests end with can fail: each kind of leftover is seen."""
    with pgbouncer.connect() as client:
        client.execute("SET work_mem = '7MB'")
        client.execute(f"LISTEN {NOTIFY_CHANNEL}")
        client.execute("SELECT pg_advisory_lock(77)")
        client.execute("CREATE TEMP TABLE leftover (x int)")
        client.execute("PREPARE leftover AS SELECT 1")
        found = pgbouncer.leftovers()
    kinds = {kind for state in found.values() for kind in state}
    assert kinds == {"settings", "listening", "advisory_locks", "temp_tables", "prepared"}


def test_routing_sends_every_threads_connections_through_the_pooler(pgbouncer):
    direct = connection.settings_dict["HOST"]
    seen = []
    with pgbouncer.routing():
        with connection.cursor() as cur:
            cur.execute("SELECT current_database()")
            assert cur.fetchone()[0] == pgbouncer.dbname

        def other_thread() -> None:
            seen.append(connection.settings_dict["PORT"])
            connection.close()

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(10)
        clients = [c for c in pgbouncer.show("CLIENTS") if c["database"] == pgbouncer.dbname]
        assert clients
    assert seen == [str(pgbouncer.port)]
    assert connection.settings_dict["HOST"] == direct


# -- the queue -------------------------------------------------------------------------------


def test_enqueue_alone_in_bulk_and_inside_the_callers_transaction(pgbouncer):
    with pgbouncer.routing():
        one = queue.enqueue(NewJob(NOOP, job_id="one"))
        again = queue.enqueue(NewJob(NOOP, job_id="one"))  # the idempotency key holds
        many = queue.enqueue_many([NewJob(NOOP, job_id=f"m-{i}") for i in range(50)])
        with transaction.atomic():
            queue.enqueue(NewJob(NOOP, job_id="kept"))
            User.objects.create(username="business-write")
        with pytest.raises(RuntimeError), transaction.atomic():
            queue.enqueue(NewJob(NOOP, job_id="rolled-back"))
            raise RuntimeError("the caller's transaction fails")
        assert again.id == one.id and len({e.id for e in many}) == 50
    names = set(Job.objects.values_list("job_id", flat=True))
    assert {"one", "kept", "m-0", "m-49"} <= names and "rolled-back" not in names
    assert len(names) == 52
    assert User.objects.filter(username="business-write").exists()
    assert pgbouncer.leftovers() == {}


def test_claim_renew_and_every_outcome(pgbouncer):
    JobFactory.create_batch(6)
    with pgbouncer.routing():
        claimed = queue.claim([ClaimRequest(NOOP, 6)], scope=AllTenants())
        assert len(claimed) == 6
        assert queue.renew(claimed, lease=timedelta(seconds=30)) == set()
        renewal = queue.renew_leases(claimed, lease=timedelta(seconds=30))
        assert not renewal.lost
        done, retried, failed, single, *rest = claimed
        report = queue.record(
            [
                Outcome.succeeded(done),
                Outcome.retry(retried, code="handler_error", delay=3600),
                Outcome.failed(failed, code="rejected"),
            ]
        )
        assert len(report.applied) == 3
        assert queue.complete(single, {"ok": True})
        # The worker's hot path: outcomes and the next claim in one statement.
        JobFactory.create_batch(2)
        report, more = queue.record_and_claim(
            [Outcome.succeeded(job) for job in rest],
            [ClaimRequest(NOOP, 5)],
            scope=AllTenants(),
        )
        assert len(report.applied) == 2 and len(more) == 2
        assert queue.record([Outcome.succeeded(job) for job in more]).applied
    states = sorted(Job.objects.values_list("state", flat=True))
    assert states == ["failed", "queued"] + ["succeeded"] * 6
    assert pgbouncer.leftovers() == {}


def test_the_workers_maintenance_passes(pgbouncer):
    expired = timezone.now() - timedelta(seconds=1)
    lost = JobFactory(running=True, attempts=1, lease_expires_at=expired)
    exhausted = JobFactory(name=Step.job_name, attempts=3, max_attempts=5)
    spared = JobFactory(name=Step.job_name, attempts=2, max_attempts=5)
    maintenance = WorkerMaintenance(WorkerConfig(), registry(Recorder(), max_attempts=3))
    with pgbouncer.routing():
        assert [r.id for r in maintenance.recover()] == [lost.id]
        assert [r.id for r in maintenance.run_once()] == [exhausted.id]
    assert Job.objects.get(pk=lost.id).state == "queued"
    assert Job.objects.get(pk=exhausted.id).state == "failed"
    assert Job.objects.get(pk=spared.id).state == "queued"
    assert pgbouncer.leftovers() == {}


# -- the admin -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "page",
    [
        "admin:jobs_job_changelist",
        "admin:jobs_overview",
        "admin:jobs_monitor",
        "admin:jobs_performance",
        "admin:jobs_flow",
        "admin:jobs_schedules",
        "admin:jobs_process_changelist",
        "admin:jobs_batch_changelist",
        "admin:jobs_jobhistory_changelist",
        "admin:jobs_job_change",
    ],
)
def test_admin_pages_render_through_the_pooler(pgbouncer, page):
    JobFactory.create_batch(3)
    JobFactory(running=True)
    done = JobFactory(succeeded=True)
    args = [done.pk] if page.endswith("_change") else []
    with pgbouncer.routing():
        user = User.objects.create_superuser("root", password="x")
        client = Client()
        client.force_login(user)
        response = client.get(reverse(page, args=args))
        assert response.status_code == 200, response.content[:500]
        if page == "admin:jobs_job_changelist":
            assert b"test.noop.v1" in response.content
    assert pgbouncer.leftovers() == {}


def test_an_admin_action_asks_then_acts_through_the_pooler(pgbouncer):
    queued, running = JobFactory(), JobFactory(running=True)
    data = {"action": "cancel_selected", "_selected_action": [queued.pk, running.pk]}
    changelist = reverse("admin:jobs_job_changelist")
    with pgbouncer.routing():
        client = Client()
        client.force_login(User.objects.create_superuser("root", password="x"))
        assert client.post(changelist, data).context["count"] == 2
        done = client.post(changelist, {**data, "post": "yes"}, follow=True)
        assert done.status_code == 200
    assert Job.objects.get(pk=queued.pk).state == "cancelled"
    assert Job.objects.get(pk=running.pk).cancel_requested_by == "root"
    assert pgbouncer.leftovers() == {}


# -- a database restart ---------------------------------------------------------------------


def _served(bouncer: PgBouncer) -> bool:
    try:
        with bouncer.connect() as client:
            client.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def _refused(bouncer: PgBouncer) -> bool:
    try:
        with bouncer.connect() as client:
            client.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        return "server_login_retry" in str(exc)
    return False


def test_after_a_database_restart_clients_are_served_again_within_a_lease():
    """A login refused while the database starts makes PgBouncer refuse every client for
    ``server_login_retry``: enqueue fails and lease renewals too, so the pause must end well
    within a lease of the database being back (tests/support/pgbouncer.py sets what the docs
    say)."""
    if skip_reason():
        pytest.skip(skip_reason())
    with TcpProxy() as server:
        settings = {**connection.settings_dict, "HOST": server.host, "PORT": str(server.port)}
        with PgBouncer(settings, pool_size=2) as bouncer:
            assert _served(bouncer)
            server.down()
            # A client that comes now waits for a server; the pooler's login for it fails.
            waiting = threading.Thread(target=_served, args=(bouncer,), daemon=True)
            waiting.start()
            wait_for(
                lambda: "the database system is starting up" in bouncer.log_text(),
                what="a server login refused",
                interval=0.01,
            )
            assert _refused(bouncer)  # from then on, every client at once
            server.up()
            back = time.monotonic()
            wait_for(
                lambda: _served(bouncer), timeout=30, what="clients served again", interval=0.01
            )
            paused = time.monotonic() - back
            waiting.join(30)
    assert paused < DEFAULTS["LEASE"].total_seconds() / 3, f"refused for {paused:.1f}s"


# -- a worker: LISTEN proved or given up -----------------------------------------------------


def _run(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, name="test-worker")
    thread.start()
    return thread


def test_a_worker_behind_the_pooler_finds_listen_useless_warns_and_polls(pgbouncer, caplog):
    caplog.set_level(logging.INFO, logger="jobs.worker")
    recorder = Recorder()
    poll = 0.5
    with pgbouncer.routing():
        worker = Worker(
            registry(recorder), WorkerConfig(poll_interval=poll, install_signal_handlers=False)
        )
        thread = _run(worker)
        try:
            wait_for(
                lambda: worker._listener is not None and worker._listener.unproven.is_set(),
                what="the failed proof",
                interval=0.01,
            )
            assert not worker.listening
            assert _listening_gauge() == 0
            for count, text in enumerate(("first", "second", "third"), start=1):
                started = time.monotonic()
                enqueue(Echo(text=text))
                wait_for(
                    lambda n=count: len(recorder.calls) == n, timeout=5, what=text, interval=0.01
                )
                assert time.monotonic() - started < poll + 1.0  # about a poll interval
        finally:
            worker.request_stop()
            thread.join(15)
    [warning] = _listener_warnings(caplog)
    assert "--no-listen" in warning and 'JOBS["NOTIFY"]' in warning and "0.5s" in warning
    # The LISTEN that failed was undone on the server connection that ran it.
    assert pgbouncer.leftovers() == {}


def _record_listener_statements(monkeypatch) -> list[tuple[str, str]]:
    """(application_name, statement) of each statement the listener's connections send."""
    real = wakeup._connect
    sent: list[tuple[str, str]] = []

    def connect(params):
        conn = real(params)
        execute = conn.execute

        def recorded(query, *args, **kwargs):
            sent.append((params.get("application_name"), str(query)))
            return execute(query, *args, **kwargs)

        conn.execute = recorded
        return conn

    monkeypatch.setattr(wakeup, "_connect", connect)
    return sent


@pytest.mark.parametrize("pool_mode", ["transaction", "session"])
def test_no_listen_is_sent_through_a_pooler_in_any_pool_mode(pool_mode, monkeypatch, caplog):
    """Before anything that outlives a transaction, the listener asks which backend answers:
    behind a pooler it is not the one the connection was opened with, so nothing more is sent
    (a process killed at any moment leaves no LISTEN on a server the pooler lends)."""
    if skip_reason():
        pytest.skip(skip_reason())
    caplog.set_level(logging.INFO, logger="jobs.worker")
    sent = _record_listener_statements(monkeypatch)
    with PgBouncer(pool_mode=pool_mode) as bouncer, bouncer.routing():
        listener = NotifyListener(["x"], lambda name: None)
        assert listener._listen() is False
        assert listener.unproven.is_set() and not listener.listening.is_set()
        assert bouncer.leftovers() == {}
    assert sent == [("jobs-worker listener", "SELECT pg_backend_pid()")]
    [warning] = _listener_warnings(caplog)
    assert "goes through one" in warning and "no LISTEN was sent" in warning
    assert "server_lifetime" not in warning


def test_only_a_direct_connection_owns_its_session(pgbouncer):
    with wakeup._connect(_connect_params()) as direct:
        assert wakeup._owns_its_session(direct)
    with pgbouncer.routing():
        params = _connect_params()
    with wakeup._connect(params) as pooled:
        assert not wakeup._owns_its_session(pooled)
    assert pgbouncer.leftovers() == {}


def test_a_worker_on_a_direct_connection_proves_listen_and_wakes_at_once(caplog):
    caplog.set_level(logging.INFO, logger="jobs.worker")
    recorder = Recorder()
    worker = Worker(
        registry(recorder), WorkerConfig(poll_interval=60, install_signal_handlers=False)
    )
    thread = _run(worker)
    try:
        wait_for(
            lambda: worker.listening and worker.idle, what="a listening, idle worker", interval=0.01
        )
        assert _listening_gauge() == 1
        started = time.monotonic()
        enqueue(Echo(text="woken"))
        wait_for(lambda: recorder.calls, timeout=5, what="the pickup", interval=0.01)
        assert time.monotonic() - started < 2  # a NOTIFY, not the 60 s poll
    finally:
        worker.request_stop()
        thread.join(15)
    assert _listener_warnings(caplog) == []
    assert _listening_gauge() == 0


def test_the_probe_is_what_decides_when_the_backend_never_changes(monkeypatch, caplog):
    """A pool of one server: the session seems to stay, yet notices go to whoever holds it."""
    if skip_reason():
        pytest.skip(skip_reason())
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 1.0)
    caplog.set_level(logging.INFO, logger="jobs.worker")
    with PgBouncer(pool_size=1) as single, single.routing():
        listener = NotifyListener(["x"], lambda name: None, poll_interval=2.0)
        listener.start()
        try:
            wait_for(listener.unproven.is_set, what="the failed proof", interval=0.01)
            assert not listener.listening.is_set()
        finally:
            listener.stop()
        assert single.leftovers() == {}
    assert len(_listener_warnings(caplog)) == 1


def test_a_listener_proves_again_after_losing_its_connection(caplog):
    """Each new connection is proved; a reconnect after a cut listens again."""
    caplog.set_level(logging.INFO, logger="jobs.worker")
    woken = []
    listener = NotifyListener([Echo.job_name], woken.append)
    listener.start()
    try:
        wait_for(listener.listening.is_set, what="the first proof", interval=0.01)
        with connection.cursor() as cur:
            cur.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'jobs-worker listener' AND datname = current_database()"
            )
        wait_for(lambda: not listener.listening.is_set(), what="the cut noticed", interval=0.01)
        wait_for(listener.listening.is_set, what="the second proof", interval=0.01)
        with psycopg.connect(**_connect_params(), autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, Echo.job_name])
        wait_for(lambda: woken == [Echo.job_name], what="the notice", interval=0.01)
    finally:
        listener.stop()
    assert _listener_warnings(caplog) == []


def _connect_params() -> dict:
    from jobs.db import bounds as dbbounds

    return dbbounds.connect_params(connection)


def test_the_listeners_connections_never_prepare_a_statement(pgbouncer):
    """Behind the pooler a statement prepared on one backend is unknown to the next one.

    Undoing a LISTEN repeats one statement until the pooler lends the right backend: here a
    backend that does not exist, so it repeats it for as long as it tries.
    """
    with pgbouncer.routing():
        params = _connect_params()
    with wakeup._connect(params) as conn:
        assert wakeup._unlisten(conn, backend=0) is False
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
    assert pgbouncer.leftovers() == {}


def test_a_notice_brought_back_by_the_proofs_own_statement_is_no_proof(monkeypatch):
    """The probe's notice, held on the listening backend, comes back with a later statement.

    Behind a transaction-mode pooler the listener's connection is linked to no server while
    it waits, so real notices never reach it. A statement it sends after the probe may land
    on the backend that listens, though, and a notice queued there comes back with the answer:
    the flaky "proof" seen with two workers through PgBouncer. Here that backend is stopped
    (SIGSTOP) until the statement reaches it, so the notice is surely pending. A proof that
    sends nothing on the listening connection between probe and wait is not fooled.
    """
    if skip_reason():
        pytest.skip(skip_reason())
    monkeypatch.setattr(wakeup, "PROBE_TIMEOUT", 1.0)
    direct = _connect_params()  # the probe reaches PostgreSQL itself: it runs beside the stop
    listener = NotifyListener(["x"], lambda name: None)
    with PgBouncer(pool_size=1) as single, single.routing():
        with wakeup._connect(_connect_params()) as conn:
            with conn.transaction():
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                backend = _backend(conn)
            os.kill(backend, signal.SIGSTOP)
            resume = threading.Timer(0.5, os.kill, [backend, signal.SIGCONT])
            resume.start()
            try:
                proved = listener._prove(conn, backend, direct)
            finally:
                resume.cancel()
                os.kill(backend, signal.SIGCONT)
            wakeup._unlisten(conn, backend)
        assert single.leftovers() == {}
    assert proved is False
