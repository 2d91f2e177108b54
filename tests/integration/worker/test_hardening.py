"""A worker nothing can wedge: whatever a handler returns, raises or leaves behind.

Each test drives the real worker in-process against real PostgreSQL with a handler that
misbehaves on purpose (tests/support/worker.py: ``hostile``), and checks that the bad job
ends in a valid state with a readable cause while every other job, and the worker, go on.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import Payload, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.models import Job, TenantOverride
from jobs.queue import NewJob
from jobs.worker import metrics
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, make_context
from jobs.worker.leases import LeaseKeeper
from jobs.worker.runner import Worker
from tests.support.factories import JobFactory
from tests.support.polling import wait_for
from tests.support.worker import (
    Echo,
    Hostile,
    Recorder,
    hostile_registry,
    refusing_trigger,
    run_until,
    settled,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def recorder():
    return Recorder()


def echoes(count: int) -> list[int]:
    return [enqueue(Echo(text=f"e{i}")).id for i in range(count)]


def job(pk: int) -> Job:
    return Job.objects.get(pk=pk)


class TestPoisonOutcomes:
    @pytest.mark.parametrize(
        "action, state, detail",
        [
            ("nul-error", "failed", "bad\\x00text and a lone \\udc80 surrogate"),
            ("nan-result", "failed", "Out of range float values are not JSON compliant"),
            ("nul-result", "failed", "a string contains a NUL character (\\u0000): $.text"),
            ("datetime-result", "failed", "Object of type datetime is not JSON serializable"),
            ("retry-max", "failed", "retry requested after"),
        ],
    )
    def test_one_bad_outcome_fails_alone_and_the_worker_goes_on(
        self, recorder, action, state, detail
    ):
        before = echoes(5)
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": action}, max_attempts=1)).id
        after = echoes(5)
        late: list[int] = []

        def done(w: Worker) -> bool:
            if not settled(*before, poison, *after):
                return False
            if not late:  # the same worker must still claim new work
                late.append(enqueue(Echo(text="late")).id)
            return settled(*late) and w.idle

        run_until(hostile_registry(recorder), done, concurrency=8)

        assert {job(pk).state for pk in before + after + late} == {"succeeded"}
        bad = job(poison)
        assert (bad.state, bad.last_error) == (state, "handler_error")
        assert detail in bad.error_detail

    def test_retry_delays_are_clamped_to_the_documented_maximum(self, recorder):
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "retry-max"})).id

        run_until(hostile_registry(recorder), lambda w: settled(poison) and w.idle)

        ahead = job(poison).run_after - timezone.now()
        assert queue.RETRY_DELAY_MAX - timedelta(minutes=1) < ahead <= queue.RETRY_DELAY_MAX

    def test_an_outcome_the_database_refuses_is_written_alone_as_a_failure(self, recorder, caplog):
        # A user's trigger (or constraint) may refuse a value the worker cannot foresee.
        with refusing_trigger("results saying refuse-me are refused", "check_violation"):
            before = echoes(4)
            poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "refuse-me"})).id
            after = echoes(4)
            with caplog.at_level(logging.WARNING, logger="jobs.worker"):
                run_until(
                    hostile_registry(recorder),
                    lambda w: settled(*before, poison, *after) and w.idle,
                    concurrency=8,
                )

        assert {job(pk).state for pk in before + after} == {"succeeded"}
        bad = job(poison)
        assert (bad.state, bad.last_error) == ("failed", "handler_error")
        assert "the database refused this attempt's outcome (succeeded)" in bad.error_detail
        assert "results saying refuse-me are refused" in bad.error_detail
        assert "writing them one by one" in caplog.text


class TestAnyException:
    @pytest.mark.parametrize(
        "action, name",
        [
            ("system-exit", "SystemExit: 3"),
            ("keyboard-interrupt", "KeyboardInterrupt"),
            ("cancelled-error", "CancelledError"),
            ("unruly", "Unruly: not an Exception"),
        ],
    )
    def test_a_base_exception_is_an_outcome_and_frees_the_slot(self, recorder, action, name):
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": action}, max_attempts=1)).id
        after = echoes(3)

        threads: list[int] = []

        def done(w: Worker) -> bool:
            if settled(poison, *after) and w.idle:
                threads.append(w.executor.pool.alive)
                return True
            return False

        run_until(hostile_registry(recorder), done, concurrency=1)

        bad = job(poison)
        assert (bad.state, bad.last_error) == ("failed", "handler_error")
        assert name in bad.error_detail
        assert {job(pk).state for pk in after} == {"succeeded"}
        assert threads == [1], "the handler thread is alive (or was replaced)"

    def test_a_base_exception_is_retried_like_any_other_error(self, recorder):
        poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "unruly"}, max_attempts=2)).id

        run_until(hostile_registry(recorder), lambda w: job(poison).state == "failed" and w.idle)

        bad = job(poison)
        assert (bad.state, bad.attempts, bad.last_error) == ("failed", 2, "handler_error")
        assert len(recorder.calls) == 2, "the second attempt ran the handler again"

    def test_any_exception_while_decoding_is_invalid_payload(self):
        class PickyV1(Payload, name="test.picky.v1"):
            key: str

            def validate(self) -> None:
                {}[self.key]  # a KeyError, not a ValueError

        picky = queue.enqueue(NewJob(PickyV1.job_name, {"key": "missing"})).id
        registry = Registry([JobType(PickyV1, lambda p, c: None, Policy())])

        run_until(registry, lambda w: settled(picky) and w.idle)

        bad = job(picky)
        assert (bad.state, bad.last_error, bad.attempts) == ("failed", "invalid_payload", 1)
        assert "KeyError: 'missing'" in bad.error_detail


class TestOpenTransactions:
    @pytest.mark.parametrize(
        "action, tenant", [("open-atomic", "left-open"), ("autocommit-off", "no-autocommit")]
    )
    def test_a_handler_that_leaves_a_transaction_open_fails(self, recorder, action, tenant):
        bad = queue.enqueue(NewJob(Hostile.job_name, {"action": action}, max_attempts=1)).id
        after = echoes(3)

        run_until(
            hostile_registry(recorder),
            lambda w: settled(bad, *after) and w.idle,
            concurrency=1,
        )

        failed = job(bad)
        assert (failed.state, failed.last_error) == ("failed", "handler_error")
        assert "left a transaction open on database default" in failed.error_detail
        assert not TenantOverride.objects.filter(tenant=tenant).exists(), "rolled back"
        assert {job(pk).state for pk in after} == {"succeeded"}


class TestDatabaseErrors:
    def test_the_loop_backs_off_with_one_line_per_retry(self, recorder, caplog):
        with connection.cursor() as cur:
            cur.execute("ALTER TABLE jobs_job RENAME TO jobs_job_away")
        started = time.monotonic()
        cpu = time.process_time()
        seen: dict[str, float] = {}
        late: list[int] = []

        def errors() -> int:
            return sum("database error in the run loop" in r.getMessage() for r in caplog.records)

        def done(w: Worker) -> bool:
            if "errors" not in seen:
                if errors() < 5:
                    return False
                seen["errors"] = time.monotonic() - started
                seen["cpu"] = time.process_time() - cpu
                with connection.cursor() as cur:
                    cur.execute("ALTER TABLE jobs_job_away RENAME TO jobs_job")
                late.append(enqueue(Echo(text="after the outage")).id)
            return settled(*late) and w.idle

        try:
            with caplog.at_level(logging.INFO, logger="jobs.worker"):
                run_until(hostile_registry(recorder), done, error_backoff_max=0.5)
        finally:
            with connection.cursor() as cur:
                cur.execute("ALTER TABLE IF EXISTS jobs_job_away RENAME TO jobs_job")

        # Five failures with a doubling wait from the 0.05 s poll interval take at least
        # 0.05 + 0.1 + 0.2 + 0.4 s; a spinning loop gets there in milliseconds.
        assert seen["errors"] >= 0.7
        assert seen["cpu"] < 0.5 * seen["errors"]
        assert job(late[0]).state == "succeeded"
        tracebacks = [r for r in caplog.records if r.exc_info and "run loop" in r.getMessage()]
        assert len(tracebacks) == 1, "a traceback for the first failure, one line afterwards"


class TestLeaseBookkeeping:
    def test_a_renewal_racing_our_own_outcome_is_not_a_lost_lease(self, recorder, caplog):
        done = queue.enqueue(NewJob(Echo.job_name, {"text": "x"}))
        [claimed] = queue.claim([queue.ClaimRequest(Echo.job_name, 1)], scope=queue.AllTenants())
        registry = hostile_registry(recorder)
        running = Running(
            claimed, registry[Echo.job_name], make_context(claimed, registry[Echo.job_name])
        )
        running.finished = True
        assert queue.complete(claimed, "x")  # the outcome commits before the renewal runs
        keeper = LeaseKeeper(lambda: [running], lease_seconds=10)
        lost_before = metrics.lost_leases.labels(Echo.job_name)._value.get()

        with caplog.at_level(logging.WARNING, logger="jobs.worker"):
            keeper.renew_once()

        assert not running.lost and not running.ctx.cancelled.is_set()
        assert metrics.lost_leases.labels(Echo.job_name)._value.get() == lost_before
        assert "lost the lease" not in caplog.text
        assert job(done.id).state == "succeeded"


class TestRecovery:
    def test_an_expired_lease_comes_back_within_a_second_at_default_settings(self, recorder):
        expires = {}

        def done(w: Worker) -> bool:
            if not expires:  # once the worker is past its first maintenance pass
                dead = JobFactory(
                    name=Echo.job_name,
                    payload={"text": "orphan"},
                    running=True,
                    attempts=1,
                    lease_expires_at=timezone.now() + timedelta(milliseconds=300),
                )
                expires[dead.pk] = time.monotonic() + 0.3
                return False
            [(pk, at)] = expires.items()
            if job(pk).state != "succeeded":
                return False
            expires["took"] = time.monotonic() - at
            return True

        worker = Worker(hostile_registry(recorder), WorkerConfig(install_signal_handlers=False))
        deadline = time.monotonic() + 10
        worker.run(until=lambda w: time.monotonic() > deadline or done(w))

        assert "took" in expires, "the orphaned job was not recovered"
        assert expires["took"] <= 1.5


def test_pool_threads_survive_a_task_that_raises_base_exception():
    from jobs.worker.pool import HandlerPool

    pool = HandlerPool(2)
    ran = []

    def bad():
        raise SystemExit(1)

    for _ in range(4):
        pool.submit(bad)
    pool.submit(lambda: ran.append(True))
    wait_for(lambda: ran, timeout=5, what="a task run after the ones that raised", interval=0.01)
    assert pool.alive == 2
    assert pool.shutdown(timeout=5)


class TestBounds:
    def test_the_loop_is_bounded_and_handlers_are_not(self):
        seen: dict[str, str] = {}

        def show() -> str:
            with connection.cursor() as cur:
                cur.execute("SHOW statement_timeout")
                return cur.fetchone()[0]

        def handler_probe(payload, ctx):
            seen["handler"] = show()

        done = queue.enqueue(NewJob(Echo.job_name, {"text": "x"})).id
        reg = Registry([JobType(Echo, handler_probe, Policy())])

        def until(w: Worker) -> bool:
            seen.setdefault("loop", show())
            return settled(done) and w.idle

        run_until(reg, until)
        assert seen == {"loop": "5s", "handler": "0"}


class TestTroubleStaysWithItsJob:
    """Whatever one job's handler or row does (a mangled context, a stall past its lease, a
    row another session locks, a refusal, a lock timeout, a huge result, an unreadable
    payload, tricks on the raw connection), the trouble stays with that job."""

    def test_a_handler_mangling_its_context_cannot_kill_the_lease_keeper(self, recorder):
        mangler = queue.enqueue(NewJob(Hostile.job_name, {"action": "mangle-ctx", "seconds": 0.2}))
        innocent = queue.enqueue(NewJob(Hostile.job_name, {"action": "slow-first", "seconds": 2}))

        run_until(
            hostile_registry(recorder),
            lambda w: settled(mangler.id, innocent.id) and w.idle,
            lease=timedelta(seconds=0.6),
        )

        assert (job(innocent.id).state, job(innocent.id).attempts) == ("succeeded", 1)
        assert job(mangler.id).state in ("succeeded", "failed")  # it broke its own context

    def test_a_reclaimed_job_does_not_lose_its_live_attempt(self, recorder):
        # What a stall past the lease does: the job is requeued while this worker runs it.
        held = queue.enqueue(
            NewJob(Hostile.job_name, {"action": "slow-first", "seconds": 1.5}, max_attempts=5)
        )
        moved = []

        def done(w: Worker) -> bool:
            if not moved and job(held.id).state == "running":
                moved.append(
                    Job.objects.filter(pk=held.id, state="running").update(
                        state="queued",
                        run_after=timezone.now(),
                        claim_token=None,
                        lease_expires_at=None,
                        claimed_by="",
                    )
                )
            return bool(moved) and settled(held.id) and w.idle

        run_until(hostile_registry(recorder), done, lease=timedelta(seconds=0.6))

        final = job(held.id)
        assert (final.state, final.attempts, final.result) == ("succeeded", 2, {"attempt": 2})
        first_ctx = recorder.calls[0][1]
        assert first_ctx.cancelled.is_set(), "the stale attempt was told to stop"

    def test_a_row_locked_by_another_session_holds_back_only_its_own_outcome(self, recorder):
        import threading

        locked = queue.enqueue(NewJob(Hostile.job_name, {"action": "ok"}))
        release = threading.Event()
        holding = threading.Event()

        def hold_lock():
            from django.db import connection as conn
            from django.db import transaction

            with transaction.atomic():
                list(Job.objects.select_for_update().filter(pk=locked.id))
                holding.set()
                release.wait(20)
            conn.close()

        holder = threading.Thread(target=hold_lock)
        later: list[int] = []
        timing: dict[str, float] = {}

        def done(w: Worker) -> bool:
            if not later and w.completer.deferred:  # the locked job's outcome is waiting
                timing["start"] = time.monotonic()
                later.extend(echoes(3))
            if later and "others" not in timing and settled(*later):
                timing["others"] = time.monotonic() - timing["start"]
                release.set()
            return "others" in timing and settled(locked.id) and w.idle

        holder_started = False
        try:

            def start_holder(w):
                nonlocal holder_started
                if not holder_started and job(locked.id).state == "running":
                    holder_started = True
                    holder.start()
                    holding.wait(5)
                return done(w)

            run_until(hostile_registry(recorder), start_holder, timeout=25)
        finally:
            release.set()
            if holder_started:
                holder.join(10)

        assert timing["others"] < 1.5, "unrelated outcomes and claims went on"
        assert job(locked.id).state == "succeeded"

    def test_a_refusal_filed_as_operational_error_is_still_isolated(self, recorder):
        """A program limit (an index row over its size, say) refuses the data itself."""
        with refusing_trigger("refused", "program_limit_exceeded"):
            poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "refuse-me"})).id
            others = echoes(3)
            run_until(hostile_registry(recorder), lambda w: settled(poison, *others) and w.idle)
        assert job(poison).state == "failed"
        assert {job(pk).state for pk in others} == {"succeeded"}

    def test_a_lock_timeout_is_contention_whoever_raises_it_never_a_failure(self, recorder):
        """What says "lock not available" is taken for contention, even a trigger of yours:
        the outcome waits, the others go on, and it is written once the error stops."""
        with refusing_trigger("refused", "lock_not_available"):
            poison = queue.enqueue(NewJob(Hostile.job_name, {"action": "refuse-me"})).id
            others = echoes(3)
            run_until(
                hostile_registry(recorder),
                lambda w: settled(*others) and job(poison).state == "running" and w.idle is False,
            )
        assert job(poison).state == "running"  # its outcome waited, its lease kept
        assert {job(pk).state for pk in others} == {"succeeded"}

    def test_a_huge_result_fails_the_attempt(self, recorder):
        big = queue.enqueue(NewJob(Hostile.job_name, {"action": "huge-result"})).id
        run_until(hostile_registry(recorder), lambda w: settled(big) and w.idle)
        assert (job(big).state, job(big).last_error) == ("failed", "handler_error")
        assert "over the 1,000,000 a job may store" in job(big).error_detail

    def test_a_payload_python_cannot_read_fails_alone(self, recorder):
        with connection.cursor() as cur:  # another producer wrote a number Python refuses
            cur.execute(
                "INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, "
                "max_attempts, run_after, state, attempts, last_error, error_detail, "
                "claimed_by, key_held, replayed_by, created_at) VALUES ('big', %s, "
                "jsonb_build_object('action', 'ok', 'n', 1e5000::numeric), 'default', "
                "'default', 0, 3, now(), 'queued', 0, '', '', '', true, '', now()) RETURNING id",
                [Hostile.job_name],
            )
            poison = cur.fetchone()[0]
        others = echoes(3)
        run_until(hostile_registry(recorder), lambda w: settled(poison, *others) and w.idle)
        poisoned = Job.objects.filter(pk=poison).values_list("state", "last_error", "error_detail")
        [(state, code, detail)] = poisoned
        assert (state, code) == ("failed", "invalid_payload")
        assert "Exceeds the limit" in detail
        assert {job(pk).state for pk in others} == {"succeeded"}

    def test_closing_the_raw_connection_after_committing_is_not_an_open_transaction(self, recorder):
        done = queue.enqueue(NewJob(Hostile.job_name, {"action": "raw-close"})).id
        run_until(hostile_registry(recorder), lambda w: settled(done) and w.idle, concurrency=1)
        assert job(done).state == "succeeded"
        assert TenantOverride.objects.filter(tenant__startswith="raw-close").count() == 1

    def test_raw_autocommit_off_fails_that_job_not_the_next(self, recorder):
        bad = queue.enqueue(
            NewJob(Hostile.job_name, {"action": "raw-autocommit-off"}, max_attempts=1)
        ).id
        after = echoes(2)
        run_until(
            hostile_registry(recorder),
            lambda w: settled(bad, *after) and w.idle,
            concurrency=1,
        )
        assert "left a transaction open" in job(bad).error_detail
        assert {job(pk).state for pk in after} == {"succeeded"}

    @pytest.mark.parametrize("action", ["broken-retry-after", "zero-attempt"])
    def test_worker_side_surprises_on_the_last_attempt_fail_at_once(self, recorder, action):
        bad = queue.enqueue(NewJob(Hostile.job_name, {"action": action}, max_attempts=1)).id
        started = time.monotonic()
        run_until(
            hostile_registry(recorder),
            lambda w: settled(bad) and w.idle,
            maintenance_interval=15,
        )
        assert (job(bad).state, job(bad).last_error) == ("failed", "handler_error")
        assert time.monotonic() - started < 5, "not left for the exhaustion pass"

    def test_the_workers_writes_on_handler_connections_are_bounded_locally(self):
        from jobs.db import bounds as dbbounds

        def show() -> str:
            with connection.cursor() as cur:
                cur.execute("SHOW lock_timeout")
                return cur.fetchone()[0]

        with dbbounds.local():
            inside = show()
        assert (inside, show()) == ("2s", "0"), "SET LOCAL ends with its transaction"


def test_drain_writes_an_outcome_deferred_by_a_row_lock_before_it_exits(recorder):
    """A finished job whose row another session held locked is written once the lock goes."""
    locked, unlock, draining = threading.Event(), threading.Event(), threading.Event()
    done = enqueue(Echo(text="locked out"))

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=done.id)
                locked.set()
                assert unlock.wait(10)
        finally:
            connection.close()

    def handle(payload: Echo, ctx) -> str:
        holder.start()
        assert locked.wait(5)  # the outcome will meet a locked row
        return payload.text

    holder = threading.Thread(target=hold_the_row)

    def stop_once_deferred(w: Worker) -> bool:
        if w.completer.deferred and not draining.is_set():
            draining.set()
            threading.Timer(0.3, unlock.set).start()  # the lock goes while the worker drains
            return True
        return False

    run_until(Registry([JobType(Echo, handle, Policy())]), stop_once_deferred)
    holder.join(10)

    row = job(done.id)
    assert (row.state, row.result) == ("succeeded", "locked out")
