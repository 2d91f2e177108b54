"""The processes table (jobs.queue.processes) against PostgreSQL: register, beat, prune, read.

Time is PostgreSQL's: rows are put on either side of a cutoff by their ``expires_at`` and by
passing ``now``, never by sleeping. The beat rides on the lease renewal, and a lock on a
process row, or a row that is gone, never holds the renewal up.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from jobs import enqueue, queue
from jobs.db.clock import database_now
from jobs.models import Job, Process
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    ProcessBeat,
    processes,
)
from jobs.runtime.process import Presence, process_identity
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.retention import Retention, RetentionConfig
from jobs.scheduler.runner import Scheduler
from jobs.worker.config import DEFAULT_CONCURRENCY, WorkerConfig
from jobs.worker.leases import LeaseKeeper
from jobs.worker.presence import describe, worker_presence
from jobs.worker.runner import Worker
from tests.support.polling import wait_for
from tests.support.process_rows import claim_for, register, shift
from tests.support.worker import Echo, Recorder, Step, registry

pytestmark = pytest.mark.django_db(transaction=True)


class TestRegister:
    def test_a_row_with_what_the_process_said_and_the_database_clock(self):
        before = database_now()
        register(scope="component worker", concurrency=8, expires_in=10)
        row = Process.objects.get()
        assert (row.identity, row.component, row.host, row.pid, row.version) == (
            "h:1:aa",
            "worker",
            "h",
            1,
            "0.1.0",
        )
        assert (row.scope, row.concurrency, row.held, row.draining, row.leader) == (
            "component worker",
            8,
            0,
            False,
            False,
        )
        assert before <= row.started_at == row.last_seen_at
        assert row.expires_at - row.last_seen_at == timedelta(seconds=10)

    def test_the_same_identity_again_replaces_the_row_of_the_former_process(self):
        register(pid=1, version="0.0.9")
        processes.beat(ProcessBeat("h:1:aa", held=3, draining=True, expires_in=10))
        shift("h:1:aa", started_at=60)
        register(pid=1, version="0.1.0")
        row = Process.objects.get()
        assert (row.version, row.held, row.draining) == ("0.1.0", 0, False)
        assert row.started_at == row.last_seen_at, "started anew"

    def test_identities_carry_host_and_pid_and_a_nonce_per_start(self):
        host, pid = socket.gethostname(), os.getpid()
        assert re.fullmatch(rf"{re.escape(host)}:{pid}:[0-9a-f]{{4}}", process_identity())
        assert WorkerConfig().identity.startswith(f"{host}:{pid}:")
        assert SchedulerConfig().identity.startswith(f"{host}:{pid}:")


class TestBeat:
    def test_a_beat_refreshes_the_row_and_says_whether_there_was_one(self):
        register(expires_in=10)
        shift("h:1:aa", last_seen_at=5, expires_at=5)
        assert processes.beat(ProcessBeat("h:1:aa", 2, False, expires_in=1.5, leader=True))
        row = processes.status()[0]
        assert (row.held, row.leader, row.seen_ago < 1) == (2, True, True)
        assert row.expires_at - row.last_seen_at == timedelta(seconds=1.5)
        assert not processes.beat(ProcessBeat("nobody", 0, False, expires_in=1))

    def test_the_lease_renewal_carries_the_beat_with_and_without_held_jobs(self):
        register("w:1:aa", expires_in=10)
        shift("w:1:aa", last_seen_at=5)
        queue.renew_leases([], beat=ProcessBeat("w:1:aa", 0, False, expires_in=10))
        assert processes.status()[0].seen_ago < 1

        jobs = claim_for("w:1:aa", 2)
        shift("w:1:aa", last_seen_at=5)
        with CaptureQueriesContext(connection) as ctx:
            renewal = queue.renew_leases(jobs, beat=ProcessBeat("w:1:aa", 2, True, expires_in=10))
        assert len(ctx.captured_queries) == 1, "the beat rides in the renewal statement"
        assert not renewal.lost
        row = processes.status()[0]
        assert (row.held, row.draining, row.state, row.seen_ago < 1) == (2, True, "draining", True)


class TestUnregister:
    def test_a_clean_stop_deletes_only_its_own_row(self):
        register("a:1:aa")
        register("b:2:bb")
        assert processes.unregister("a:1:aa")
        assert not processes.unregister("a:1:aa")
        assert list(Process.objects.values_list("identity", flat=True)) == ["b:2:bb"]


class TestPruneGone:
    def test_deletes_rows_gone_longer_than_the_retention_only(self):
        register("live:1:aa", expires_in=10)
        register("just-gone:2:bb", expires_in=10)
        register("long-gone:3:cc", expires_in=10)
        shift("just-gone:2:bb", expires_at=3600 - 5 + 10)  # gone for 59m55s
        shift("long-gone:3:cc", expires_at=3600 + 5 + 10)  # gone for 1h00m05s

        assert processes.prune_gone(older_than=timedelta(hours=1)) == 1
        left = set(Process.objects.values_list("identity", flat=True))
        assert left == {"live:1:aa", "just-gone:2:bb"}

    def test_now_is_a_parameter_and_the_limit_bounds_one_statement(self):
        for i in range(3):
            register(f"g:{i}:aa", expires_in=1)
        later = database_now() + timedelta(seconds=60)
        assert processes.prune_gone(older_than=timedelta(seconds=30), limit=2, now=later) == 2
        assert processes.prune_gone(older_than=timedelta(seconds=30), now=later) == 1
        assert not Process.objects.exists()

    def test_the_default_retention_is_the_setting(self):
        register("g:1:aa", expires_in=1)
        shift("g:1:aa", expires_at=120)
        assert processes.prune_gone() == 0, "one hour by default"
        with override_settings(JOBS={"PROCESS_RETENTION": 60}):
            assert processes.prune_gone() == 1

    def test_the_scheduler_retention_pass_prunes_them(self):
        register("g:1:aa", expires_in=1)
        register("live:2:bb", expires_in=10)
        shift("g:1:aa", expires_at=120)
        counts = Retention(RetentionConfig(process_retention=timedelta(seconds=60))).run_once()
        assert counts["jobs.process:gone"] == 1
        assert list(Process.objects.values_list("identity", flat=True)) == ["live:2:bb"]


class TestStatus:
    def test_states_by_the_database_clock_and_the_jobs_each_holds(self):
        register("w1:1:aa", concurrency=4)
        register("w2:2:bb", concurrency=2)
        register("gone:3:cc", concurrency=2)
        register("s:4:dd", component="scheduler")
        shift("gone:3:cc", expires_at=11, last_seen_at=11)
        processes.beat(ProcessBeat("w2:2:bb", 0, True, expires_in=10))
        processes.beat(ProcessBeat("s:4:dd", 0, False, expires_in=10, leader=True))
        held = claim_for("w1:1:aa", 2)
        Job.objects.filter(pk=held[0].id).update(started_at=database_now() - timedelta(seconds=90))

        rows = {row.identity: row for row in processes.status()}

        assert {i: r.state for i, r in rows.items()} == {
            "w1:1:aa": "ready",
            "w2:2:bb": "draining",
            "gone:3:cc": "gone",
            "s:4:dd": "ready",
        }
        assert [r.identity for r in processes.status()][-1] == "s:4:dd", "workers first"
        w1 = rows["w1:1:aa"]
        assert [job.id for job in w1.jobs] == [held[0].id, held[1].id], "oldest first"
        assert 90 <= w1.jobs[0].elapsed < 100
        assert w1.jobs[0].name == Echo.job_name and w1.jobs[0].attempts == 1
        assert rows["w2:2:bb"].jobs == () and rows["gone:3:cc"].seen_ago >= 11
        assert rows["s:4:dd"].leader and rows["s:4:dd"].free is None
        assert (rows["w1:1:aa"].free, rows["w2:2:bb"].free, rows["gone:3:cc"].free) == (4, 0, 0)
        assert [r.identity for r in processes.status("w2:2:bb")] == ["w2:2:bb"]

    def test_finished_and_requeued_jobs_are_not_held(self):
        register("w:1:aa")
        [job] = claim_for("w:1:aa")
        assert len(processes.status()[0].jobs) == 1
        queue.complete(job, "done")
        assert processes.status()[0].jobs == ()

    def test_capacity_counts_live_workers_and_the_free_slots_of_those_that_claim(self):
        assert processes.capacity() == (0, 0, 0)
        register("w1:1:aa", concurrency=4)
        register("w2:2:bb", concurrency=10)
        register("drain:3:cc", concurrency=10)
        register("gone:4:dd", concurrency=10)
        register("s:5:ee", component="scheduler")
        processes.beat(ProcessBeat("w1:1:aa", 3, False, expires_in=10))
        processes.beat(ProcessBeat("drain:3:cc", 1, True, expires_in=10))
        shift("gone:4:dd", expires_at=11)

        capacity = processes.capacity()
        assert capacity == (3, 1 + 10, 1)
        assert (capacity.workers, capacity.free, capacity.draining) == (3, 11, 1)


class TestPresence:
    def test_register_beat_unregister(self):
        presence = Presence("p:1:aa", component="scheduler", expires_in=10)
        assert presence.beat() is not None and presence.registered, "registers first"
        assert presence.send(leader=True)
        assert Process.objects.get().leader
        presence.unregister()
        assert not Process.objects.exists() and not presence.registered

    def test_a_row_pruned_meanwhile_is_registered_again(self):
        presence = Presence("p:1:aa", component="scheduler", expires_in=10)
        assert presence.register()
        Process.objects.all().delete()
        assert presence.send(leader=True)
        assert Process.objects.get().leader

    def test_a_refused_registration_is_logged_once_and_tried_again(self, caplog, monkeypatch):
        presence = Presence("p:1:aa", component="worker", expires_in=10)
        real = processes.register
        monkeypatch.setattr(processes, "register", _raise)
        assert presence.beat() is None and presence.beat() is None
        assert caplog.text.count("could not register process p:1:aa") == 1
        monkeypatch.setattr(processes, "register", real)
        assert presence.beat() is not None
        assert Process.objects.filter(identity="p:1:aa").exists()

    def test_the_worker_scope_as_the_option_that_gives_it(self):
        from jobs.worker.config import scope_from

        assert describe(scope_from(None, None)) == "component worker"
        assert describe(scope_from(None, "mailer")) == "component mailer"
        assert describe(scope_from("acme", None)) == "tenant acme"
        assert describe(AllTenants()) == "all tenants"
        presence = worker_presence(WorkerConfig(concurrency=3, lease=timedelta(seconds=2)))
        assert (presence.concurrency, presence.expires_in) == (3, 2.0)


def _raise(*args, **kwargs):
    raise RuntimeError("refused")


class TestKeeper:
    def test_an_idle_keeper_beats_and_a_busy_one_beats_in_its_renewal(self):
        presence = Presence("k:1:aa", component="worker", expires_in=10)
        presence.register()
        shift("k:1:aa", last_seen_at=5)
        held: list = []
        keeper = LeaseKeeper(lambda: held, lease_seconds=10, beat=lambda: presence.beat(held=7))
        with CaptureQueriesContext(connection) as ctx:
            assert keeper.renew_once() == set()
        assert len(ctx.captured_queries) == 1
        row = processes.status()[0]
        assert (row.held, row.seen_ago < 1) == (7, True)

    def test_without_a_beat_an_idle_keeper_makes_no_statement(self):
        keeper = LeaseKeeper(list, lease_seconds=10)
        with CaptureQueriesContext(connection) as ctx:
            assert keeper.renew_once() == set()
        assert ctx.captured_queries == []

    def test_a_beat_that_finds_its_row_pruned_registers_again_at_the_next(self):
        presence = Presence("k:1:aa", component="worker", expires_in=10)
        presence.register()
        keeper = LeaseKeeper(
            list, lease_seconds=10, beat=presence.beat, beat_missed=presence.forget
        )
        Process.objects.all().delete()  # pruned while the process stalled

        keeper.renew_once()  # the beat finds no row: the keeper says so
        assert not presence.registered and not Process.objects.exists()
        keeper.renew_once()  # registers again, then beats

        assert Process.objects.filter(identity="k:1:aa").exists() and presence.registered

    def test_a_failing_beat_provider_does_not_stop_the_renewal(self, caplog):
        keeper = LeaseKeeper(list, lease_seconds=10, beat=lambda: 1 / 0)
        assert keeper.renew_once() == set()
        assert "could not build the process beat" in caplog.text


class TestWorkerAndScheduler:
    def test_a_worker_registers_beats_while_idle_and_busy_and_leaves_on_stop(self):
        recorder = Recorder()
        config = WorkerConfig(
            lease=timedelta(seconds=0.3), poll_interval=0.05, install_signal_handlers=False
        )
        worker = Worker(registry(recorder), config)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            row = wait_for(lambda: processes.status(config.identity), timeout=5)[0]
            assert (row.component, row.concurrency, row.scope) == (
                "worker",
                DEFAULT_CONCURRENCY,
                "component worker",
            )
            first = row.last_seen_at
            wait_for(lambda: processes.status()[0].last_seen_at > first, timeout=5, what="idle")

            queue.enqueue(NewJob(Step.job_name, {"plan": ["slow"], "seconds": 30}))
            busy = wait_for(
                lambda: [r for r in processes.status() if r.held == 1 and r.jobs], timeout=5
            )[0]
            assert busy.jobs[0].name == Step.job_name
            seen = busy.last_seen_at
            wait_for(lambda: processes.status()[0].last_seen_at > seen, timeout=5, what="busy")
        finally:
            worker.request_stop(force=True)
            thread.join(10)
        assert not Process.objects.exists()

    def test_a_scheduler_registers_leads_and_leaves(self):
        config = SchedulerConfig(install_signal_handlers=False, tick_interval=0.2)
        scheduler = Scheduler(config, schedules=())
        seen: list[Process] = []

        def record(s: Scheduler) -> bool:
            seen.extend(Process.objects.all())
            return True

        scheduler.run(until=record)
        assert [(p.identity, p.component, p.leader) for p in seen] == [
            (config.identity, "scheduler", True)
        ]
        assert not Process.objects.exists()


NOOP = "test.noop.v1"


def claim(names=(NOOP,), limit=100, scope=None, worker="w1", caps=None):
    requests = [ClaimRequest(n, limit, (caps or {}).get(n)) for n in names]
    return queue.claim(requests, scope=scope or AllTenants(), worker=worker)


def row_of(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


def db_now():
    with connection.cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


class Thread(threading.Thread):
    """A thread on its own database connection that re-raises its error on ``result()``."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.error: BaseException | None = None
        self.value = None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 10):
        self.join(timeout)
        assert not self.is_alive(), "a test thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


class RowLock:
    """Hold ``FOR UPDATE`` on rows of another session's transaction until released."""

    def __init__(self, sql: str, params: list) -> None:
        self.locked, self.release = threading.Event(), threading.Event()

        def hold() -> None:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(sql, params)
                self.locked.set()
                self.release.wait(30)

        self.thread = Thread(hold)

    def __enter__(self) -> RowLock:
        self.thread.start()
        assert self.locked.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.result()


@pytest.mark.django_db(transaction=True)
def test_a_locked_process_row_does_not_block_the_lease_renewal():
    processes.register("h:1:aa", component="worker", host="h", pid=1, version="t", expires_in=10)
    queue.enqueue(NewJob(NOOP))
    [job] = claim(worker="h:1:aa")
    before = row_of(job.id).lease_expires_at
    beat = ProcessBeat("h:1:aa", 1, False, expires_in=10)

    with RowLock("SELECT 1 FROM jobs_process WHERE identity = %s FOR UPDATE", ["h:1:aa"]):
        renewer = Thread(lambda: queue.renew_leases([job], lease=timedelta(seconds=30), beat=beat))
        renewer.start()
        # (On failure the lock is released on leaving the block and the renewal returns.)
        wait_for(lambda: not renewer.is_alive(), timeout=3, what="the renewal returned")
    renewal = renewer.result()

    assert not renewal.lost
    assert row_of(job.id).lease_expires_at > before


@pytest.mark.django_db(transaction=True)
def test_a_lock_on_a_workers_process_row_does_not_stop_its_lease_renewals():
    recorder = Recorder()
    done = enqueue(Step(plan=("slow",), seconds=30))
    config = WorkerConfig(lease=timedelta(seconds=0.6), install_signal_handlers=False)
    worker = Worker(registry(recorder), config)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: recorder.calls, what="the handler started", timeout=20)
        wait_for(
            lambda: processes.status(config.identity), what="the worker registered", timeout=20
        )
        token = row_of(done.id).claim_token
        sql = "SELECT 1 FROM jobs_process WHERE identity = %s FOR UPDATE"
        with RowLock(sql, [config.identity]):  # an operator's open transaction, say
            # Every lease before the lock ends by locked_at + 0.6 s; a renewal after it, later.
            # (Were the renewal to wait for the lock, the lease would lapse and the worker's own
            # maintenance requeue the job and claim it again: a new token, an attempt used up.)
            locked_at = db_now()

            def renewed() -> bool:
                row = row_of(done.id)
                return row.claim_token == token and row.lease_expires_at > locked_at + timedelta(
                    seconds=0.6
                )

            wait_for(renewed, timeout=3, what="a renewal of the same claim after the lock")
        assert not recorder.calls[0][1].cancelled.is_set()
        assert len(recorder.calls) == 1
    finally:
        worker.request_stop(force=True)
        thread.join(10)


@pytest.mark.django_db
def test_a_renewal_whose_process_row_is_gone_still_renews_and_reports_cancels():
    queue.enqueue(NewJob(NOOP))
    queue.enqueue(NewJob(NOOP))
    held = claim(worker="gone:1:aa")
    before = {j.id: row_of(j.id).lease_expires_at for j in held}
    queue.cancel_running([held[0].id], by="alice")

    renewal = queue.renew_leases(
        held, lease=timedelta(seconds=60), beat=ProcessBeat("gone:1:aa", 2, False, 10)
    )

    assert renewal.beat_missed and not renewal.lost
    assert renewal.cancel_requested == {held[0].claim_token}
    assert all(row_of(j.id).lease_expires_at > before[j.id] for j in held)
