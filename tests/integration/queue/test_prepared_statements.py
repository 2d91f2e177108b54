"""What the queue prepares: nothing unless ``JOBS["PREPARED_STATEMENTS"]`` says so, whatever
the database's ``OPTIONS`` say, and then every statement of the queue, safely."""

from __future__ import annotations

import contextlib
import importlib

import psycopg
import pytest
from django.db import DataError, connection, transaction
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import enqueue, queue
from jobs.db import bounds as dbbounds
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, InvalidJob, NewJob, Outcome, _db
from jobs.worker.config import WorkerConfig
from jobs.worker.runner import Worker
from tests.support import noop_jobs
from tests.support.pgbouncer import pgbouncer_fixture, skip_reason  # noqa: F401
from tests.support.prepared import other_session, prepare_threshold, queue_prepares
from tests.support.worker import Echo, Recorder, registry

enqueue_module = importlib.import_module("jobs.queue.enqueue")


COPY_AT_LEAST = enqueue_module.COPY_AT_LEAST


NOOP = "test.noop.v1"


SCOPE = AllTenants()


QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def prepared() -> list[str]:
    """The statements prepared on this thread's default connection, read by a Django cursor
    (client-side binding: it never prepares anything itself)."""
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cur.fetchall()]


def claim(limit: int = 1) -> list:
    return queue.claim([ClaimRequest(NOOP, limit)], scope=SCOPE, worker="w26")


def every_kind_of_call() -> None:
    """Enqueue (single, keyed, taken key, batch, keyed batch, with after, COPY outside and
    inside a transaction), claims, outcomes, the worker's pass, renewals, admin actions."""
    first = queue.enqueue(NewJob(NOOP, {"n": 1}))
    keyed = queue.enqueue(NewJob(NOOP, {}, job_id=f"k-{first.id}"))
    again = queue.enqueue(NewJob(NOOP, {}, job_id=f"k-{first.id}"))
    assert (again.id, again.created) == (keyed.id, False)
    queue.enqueue_many([NewJob(NOOP, {"n": n}) for n in range(3)])
    queue.enqueue_many([NewJob(NOOP, {}, job_id=f"b-{first.id}-{n}") for n in range(3)])
    queue.enqueue(NewJob(NOOP, {}, after=(first.id,)))
    queue.enqueue_many([NewJob(NOOP, {"n": n}) for n in range(COPY_AT_LEAST)])
    with transaction.atomic():
        queue.enqueue_many([NewJob(NOOP, {"n": n}) for n in range(COPY_AT_LEAST)])
    [job] = claim()
    queue.record([Outcome.succeeded(job, {"ok": True})])
    [job] = claim()
    queue.renew([job])
    queue.record_and_claim([Outcome.succeeded(job)], [ClaimRequest(NOOP, 1)], scope=SCOPE)
    victim = queue.enqueue(NewJob(NOOP, {}))
    assert queue.cancel([victim.id], by="operator") == [victim.id]
    assert queue.run_now([first.id]) in ([first.id], [])


@pytest.mark.django_db(transaction=True)
def test_with_djangos_default_nothing_the_queue_does_is_prepared():
    """Behind a transaction-mode PgBouncer a prepared statement is missing on the next server
    connection: with Django's default ``prepare_threshold`` (None) no call of the queue on
    the user's connection prepares anything, COPY and its kept cursor included."""
    with prepare_threshold(None):
        every_kind_of_call()
        every_kind_of_call()
        assert prepared() == []


@pytest.mark.django_db(transaction=True)
def test_the_setting_off_prepares_nothing_even_where_the_options_would():
    """A project's ``OPTIONS["prepare_threshold"] = 0`` is for its own statements: with
    ``JOBS["PREPARED_STATEMENTS"]`` off (the default) no call of the queue prepares one."""
    with prepare_threshold(0), queue_prepares(False):
        every_kind_of_call()
        every_kind_of_call()
        assert prepared() == []


@pytest.mark.django_db(transaction=True)
def test_the_setting_on_prepares_the_queues_statements_without_any_options():
    """``JOBS["PREPARED_STATEMENTS"] = True`` prepares the queue's statements from their first
    use on a connection whose ``OPTIONS`` leave ``prepare_threshold`` unset (Django's default)."""
    with prepare_threshold(None), queue_prepares(True):
        every_kind_of_call()
        statements = prepared()
    for call in ("jobs_enqueue_job(", "Of two outcomes for one attempt", "jobs_batch"):
        assert any(call in s for s in statements), (call, [s[:70] for s in statements])


OPS = st.lists(
    st.sampled_from(
        ["calls", "close", "error-in-atomic", "rollback", "refused-after", "varied-sql"]
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.django_db(transaction=True)
@settings(max_examples=15, deadline=None, suppress_health_check=QUIET)
@given(ops=OPS)
@example(ops=["calls", "error-in-atomic", "close", "rollback", "refused-after", "varied-sql"])
def test_with_the_setting_on_any_sequence_of_queue_calls_works(ops):
    """``JOBS["PREPARED_STATEMENTS"]`` prepares every statement from its first use. Any
    sequence of: every kind of queue call, a reconnect, a failed statement inside a
    transaction (savepoint rolled back), a rolled-back transaction that copied a batch, a
    dependency refused in a savepoint, more than psycopg's 100 cached statements of varying
    text; each call answers right, and the queue's statements are prepared indeed."""
    with queue_prepares(True):
        for op in ops:
            if op == "calls":
                every_kind_of_call()
            elif op == "close":
                connection.close()
            elif op == "error-in-atomic":
                with transaction.atomic():
                    queue.enqueue(NewJob(NOOP, {}))
                    with pytest.raises(DataError), transaction.atomic():
                        queue.enqueue_many([NewJob(NOOP, {}, job_id="e") for _ in range(2)])
                        with _db.bound_cursor(None) as cur:
                            cur.execute("SELECT 1 / %(zero)s", {"zero": 0})
                    assert queue.enqueue(NewJob(NOOP, {})).created
            elif op == "rollback":
                before = Job.objects.count()
                with pytest.raises(RuntimeError), transaction.atomic():
                    queue.enqueue_many([NewJob(NOOP, {}) for _ in range(COPY_AT_LEAST)])
                    raise RuntimeError("rolled back")
                assert Job.objects.count() == before
            elif op == "refused-after":
                with transaction.atomic():
                    with pytest.raises(InvalidJob):
                        queue.enqueue(NewJob(NOOP, {}, after=(10**15,)))
                    assert queue.enqueue(NewJob(NOOP, {})).created
            else:
                for n in range(110):
                    with _db.bound_cursor(None) as cur:
                        cur.execute(f"SELECT %(v)s::int + {n}", {"v": 1})
                        assert cur.fetchone() == (n + 1,)
        queue.enqueue(NewJob(NOOP, {}))
        assert any("jobs_enqueue_job(" in s for s in prepared())


@pytest.mark.django_db(transaction=True)
def test_with_the_setting_on_a_plan_change_from_a_new_index_is_taken_in_stride():
    """Another session adds an index and drops it again while the claim is prepared here:
    the server plans the statement again each time, and every claim answers."""
    with queue_prepares(True):
        queue.enqueue_many([NewJob(NOOP, {"n": n}) for n in range(6)])
        assert len(claim()) == 1
        with other_session() as other:
            other.execute("CREATE INDEX r26_by_priority ON jobs_job (name, priority, id)")
            assert len(claim()) == 1
            other.execute("DROP INDEX r26_by_priority")
        assert len(claim()) == 1
        assert any("claimed" in s or "jobs_job" in s for s in prepared())


@pytest.mark.django_db(transaction=True)
def test_the_workers_own_connection_never_prepares_whatever_options_say():
    """docs/queue.md: "The worker's and scheduler's connections of their own never prepare."
    A project sets ``OPTIONS["prepare_threshold"] = 0`` for its web processes; a real Worker
    runs jobs, and its loop connection, read between two passes, holds no prepared statement
    (of its pass or its claims).
    """
    with prepare_threshold(0):
        jobs = [enqueue(Echo(text=str(n))) for n in range(5)]
        seen: list[str] = []

        def until(_worker: Worker) -> bool:
            done = Job.objects.filter(pk__in=[j.id for j in jobs], state="succeeded").count()
            if done < len(jobs):
                return False
            seen.extend(prepared())  # the loop's own connection, bounded, in this thread
            return True

        config = WorkerConfig(install_signal_handlers=False, poll_interval=0.05)
        Worker(registry(Recorder()), config).run(until=until)  # its loop runs on this thread
    assert seen == []


@pytest.mark.django_db(transaction=True)
def test_with_the_setting_on_a_worker_runs_its_jobs_on_prepared_statements():
    """A real Worker, with ``JOBS["PREPARED_STATEMENTS"]`` on and ``OPTIONS`` left alone, runs
    its jobs; its loop connection, read between two passes, holds its pass prepared."""
    with queue_prepares(True):
        jobs = [enqueue(Echo(text=str(n))) for n in range(5)]
        seen: list[str] = []

        def until(_worker: Worker) -> bool:
            done = Job.objects.filter(pk__in=[j.id for j in jobs], state="succeeded").count()
            if done < len(jobs):
                return False
            seen.extend(prepared())  # the loop's own connection, bounded, in this thread
            return True

        config = WorkerConfig(install_signal_handlers=False, poll_interval=0.05)
        Worker(registry(Recorder()), config).run(until=until)
    assert any("jobs_worker_pass_v3(" in s for s in seen), seen


@pytest.mark.django_db(transaction=True)
def test_a_prepared_claim_recovers_after_a_migration_changes_a_returned_column():
    """With ``JOBS["PREPARED_STATEMENTS"]`` the claim is prepared on the user's connection; a
    deploy's migration (another session) widens ``jobs_job.priority``, a column the claim
    returns. The first claim after it may fail, but the connection recovers: psycopg does not
    keep running the stale statement, so later claims answer (as the ORM, unprepared, goes on).
    """
    failures = []
    with queue_prepares(True):
        queue.enqueue_many([NewJob(NOOP, {"n": n}) for n in range(4)])
        assert len(claim()) == 1
        try:
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE integer")
            for _ in range(3):
                try:
                    claim()
                except psycopg.Error as exc:
                    failures.append(str(exc))
                except Exception as exc:
                    failures.append(str(exc))
        finally:
            connection.close()
            with other_session() as other:
                other.execute("ALTER TABLE jobs_job ALTER COLUMN priority TYPE smallint")
    assert len(failures) <= 1, failures


def prepared_statements() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_statements")
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_nothing_is_prepared_on_a_bounded_connection_whatever_options_say():
    """PgBouncer in transaction mode: no statement the worker or the scheduler sends on a
    connection of their own (``dbbounds.bounded``) may be prepared, whatever
    ``prepare_threshold`` the project's ``OPTIONS`` set (0 prepares every statement at once)
    for its own statements, while ``JOBS["PREPARED_STATEMENTS"]`` is off."""
    noop_jobs.enqueue(40)
    with prepare_threshold(0), dbbounds.bounded(connection):
        for _ in range(8):
            [job] = noop_jobs.claim(1)
            queue.record([Outcome.succeeded(job)])
            [job] = noop_jobs.claim(1)
            queue.renew([job])
            queue.next_attempt(job)
            queue.record_and_claim(
                [Outcome.succeeded(job)], [ClaimRequest(noop_jobs.NAME, 1)], scope=noop_jobs.SCOPE
            )
            queue.enqueue(NewJob(name=noop_jobs.NAME, payload={}))
            queue.enqueue_many([NewJob(name=noop_jobs.NAME, payload={})] * 2)
        assert prepared_statements() == 0


@pytest.mark.django_db(transaction=True)
def test_the_setting_on_prepares_the_queues_statements_on_a_bounded_connection_too():
    """The worker's and scheduler's own connections (``dbbounds.bounded``) prepare nothing by
    count, but ``JOBS["PREPARED_STATEMENTS"]`` reaches the queue's statements on them too."""
    noop_jobs.enqueue(4)
    with queue_prepares(True), dbbounds.bounded(connection):
        [job] = noop_jobs.claim(1)
        queue.renew([job])
        queue.record([Outcome.succeeded(job)])
        queue.enqueue(NewJob(name=noop_jobs.NAME, payload={}))
        assert any("jobs_enqueue_job(" in s for s in prepared())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside", [False, True])
def test_a_refused_prepared_statement_names_the_setting_then_the_next_call_works(inside):
    """A pooler that does not keep prepared statements sends the next execution to a server
    connection that never saw it (``prepared statement "_pg3_0" does not exist``), the same
    as a ``DEALLOCATE ALL`` behind psycopg's back. The call fails with an error that names
    ``JOBS["PREPARED_STATEMENTS"]`` and PgBouncer's ``max_prepared_statements``; the next call
    works (outside a transaction the connection is replaced; inside, the rollback forgets)."""
    with queue_prepares(True):
        assert queue.enqueue(NewJob(NOOP, {})).created
        with connection.cursor() as cur:
            cur.execute("DEALLOCATE ALL")
        block = transaction.atomic() if inside else contextlib.nullcontext()
        with pytest.raises(queue.PreparedStatementsRefused) as refused, block:
            queue.enqueue(NewJob(NOOP, {}))
        message = str(refused.value)
        assert 'JOBS["PREPARED_STATEMENTS"]' in message, message
        assert "max_prepared_statements" in message, message
        assert "does not exist" in message, message
        assert queue.enqueue(NewJob(NOOP, {})).created
        assert queue.enqueue(NewJob(NOOP, {})).created


@pytest.mark.django_db(transaction=True)
def test_through_a_pooler_that_keeps_none_each_call_works_or_is_refused_by_name(pgbouncer):
    """PgBouncer in transaction mode, without ``max_prepared_statements`` (1.18 has none),
    lends each transaction the next server connection. With the setting on, each queue call
    either works or fails as ``PreparedStatementsRefused`` (missing there, or its name
    already taken there), never as anything else, and the jobs table holds exactly the
    calls that worked."""
    worked, refused = 0, []
    with queue_prepares(True), pgbouncer.routing():
        for n in range(12):
            try:
                queue.enqueue(NewJob(NOOP, {"n": n}))
                worked += 1
            except queue.PreparedStatementsRefused as exc:
                refused.append(str(exc))
    assert worked and refused, (worked, refused)
    assert all("max_prepared_statements" in message for message in refused), refused
    assert Job.objects.count() == worked
