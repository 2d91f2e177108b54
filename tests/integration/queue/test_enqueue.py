"""Enqueue: validation, idempotency through the partial unique index, transactions."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    InvalidJob,
    NewJob,
)
from jobs.queue import keys as keys_module
from tests.support.factories import JobFactory
from tests.support.noop_jobs import NAME
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db


def test_enqueue_creates_a_queued_job_with_defaults():
    result = queue.enqueue(NewJob("mail.send.v1", {"to": "a@example.com"}, job_id="m-1"))

    job = Job.objects.get(pk=result.id)
    assert result.created is True
    assert (job.name, job.job_id, job.state, job.attempts) == ("mail.send.v1", "m-1", "queued", 0)
    assert (job.tenant, job.queue, job.priority, job.max_attempts) == ("default", "default", 0, 5)
    assert job.payload == {"to": "a@example.com"}
    assert job.key_held is True


def test_job_without_job_id_gets_a_unique_one():
    first = queue.enqueue(NewJob("a.v1"))
    second = queue.enqueue(NewJob("a.v1"))
    assert first.id != second.id
    assert first.job_id != second.job_id
    assert second.created


def test_repeat_enqueue_while_active_returns_the_existing_job():
    first = queue.enqueue(NewJob("a.v1", {"n": 1}, job_id="same"))
    again = queue.enqueue(NewJob("a.v1", {"n": 2}, job_id="same"))

    assert again.id == first.id
    assert again.created is False
    assert Job.objects.count() == 1
    assert Job.objects.get().payload == {"n": 1}


def test_same_job_id_in_other_tenant_is_separate_work():
    first = queue.enqueue(NewJob("a.v1", job_id="same", tenant="acme"))
    second = queue.enqueue(NewJob("a.v1", job_id="same", tenant="globex"))
    assert first.id != second.id and second.created


def test_duplicates_inside_one_batch_return_the_first():
    results = queue.enqueue_many(
        [
            NewJob("a.v1", {"n": 1}, job_id="dup"),
            NewJob("b.v1", job_id="other"),
            NewJob("a.v1", {"n": 2}, job_id="dup"),
        ]
    )
    assert [r.created for r in results] == [True, True, False]
    assert results[0].id == results[2].id
    assert Job.objects.count() == 2


# Job ids whose sorted order (the order rows are inserted in) is not the order they are given.
GIVEN = ["step-7", "step-2", "step-9", "step-0", "step-5", "step-1", "step-8", "step-3"]


def claim_one_by_one(name: str, count: int) -> list[str]:
    claimed = []
    for _ in range(count):
        claimed += [job.job_id for job in queue.claim([ClaimRequest(name, 1)], scope=AllTenants())]
    return claimed


def test_a_batch_is_claimed_in_the_order_it_was_given():
    queue.enqueue_many([NewJob("a.v1", {"n": n}, job_id=key) for n, key in enumerate(GIVEN)])

    assert claim_one_by_one("a.v1", len(GIVEN)) == GIVEN


def test_batch_order_holds_for_jobs_inserted_after_releasing_an_expired_key():
    """A job whose key an expired row held is inserted in a later round, in its given place."""
    JobFactory(
        name="a.v1",
        job_id="step-0",
        succeeded=True,
        finished_at=timezone.now() - timedelta(days=2),
    )
    results = queue.enqueue_many([NewJob("a.v1", job_id=key) for key in GIVEN])

    assert all(result.created for result in results)
    assert claim_one_by_one("a.v1", len(GIVEN)) == GIVEN


def test_empty_batch_inserts_nothing():
    assert queue.enqueue_many([]) == []


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (NewJob(""), "name must be a non-empty string"),
        (NewJob("a.v1", job_id=""), "job_id must be a non-empty string"),
        (NewJob("a.v1", priority=101), "priority must be a whole number from -100 to 100"),
        (NewJob("a.v1", max_attempts=0), "max_attempts must be a whole number from 1 to"),
        (NewJob("a.v1", tenant="bad tenant"), "tenant must be 1-64 characters"),
        (NewJob("a.v1", payload=["x"]), "payload must be a dict"),
        (NewJob("a.v1", payload={"x": object()}), "payload is not JSON-serializable"),
        (
            NewJob("a.v1", run_after=timezone.now(), delay=timedelta(seconds=1)),
            "give run_after or delay, not both",
        ),
        (
            NewJob("a.v1", run_after=timezone.now().replace(tzinfo=None)),
            "run_after must be an aware datetime",
        ),
    ],
)
def test_one_invalid_job_rejects_the_whole_batch(job, message):
    batch = [NewJob("ok.v1", job_id="fine-1"), job, NewJob("ok.v1", job_id="fine-2")]

    with pytest.raises(InvalidJob, match=f"job #1: {message}") as raised:
        queue.enqueue_many(batch)

    assert raised.value.index == 1
    assert Job.objects.count() == 0


def test_delay_and_run_after_set_the_due_time():
    later = timezone.now() + timedelta(hours=1)
    delayed = queue.enqueue(NewJob("a.v1", delay=timedelta(minutes=5)))
    scheduled = queue.enqueue(NewJob("a.v1", run_after=later))

    delayed_job = Job.objects.get(pk=delayed.id)
    assert delayed_job.run_after - delayed_job.created_at == timedelta(minutes=5)
    assert Job.objects.get(pk=scheduled.id).run_after == later
    assert queue.claim([ClaimRequest("a.v1", 10)], scope=AllTenants()) == []


class TestWindows:
    """A terminal job keeps its job_id for its window, then lets the same work run again."""

    def test_success_window_returns_the_succeeded_job(self):
        done = JobFactory(job_id="w", succeeded=True)
        again = queue.enqueue(NewJob("test.noop.v1", job_id="w"))
        assert (again.id, again.created, again.state) == (done.id, False, "succeeded")

    def test_after_the_success_window_the_work_runs_again(self):
        old = JobFactory(
            job_id="w", succeeded=True, finished_at=timezone.now() - timedelta(hours=24, seconds=1)
        )
        again = queue.enqueue(NewJob("test.noop.v1", job_id="w"))
        assert again.created and again.id != old.id
        old.refresh_from_db()
        assert old.key_held is False

    def test_just_inside_the_success_window_nothing_runs(self):
        JobFactory(
            job_id="w", succeeded=True, finished_at=timezone.now() - timedelta(hours=23, minutes=59)
        )
        assert queue.enqueue(NewJob("test.noop.v1", job_id="w")).created is False

    @override_settings(JOBS={"FAILURE_WINDOW": 30})
    def test_failure_window_is_short_and_configurable(self):
        recent = JobFactory(
            job_id="f", failed=True, finished_at=timezone.now() - timedelta(seconds=20)
        )
        assert queue.enqueue(NewJob("test.noop.v1", job_id="f")).id == recent.id
        Job.objects.filter(pk=recent.pk).update(finished_at=timezone.now() - timedelta(seconds=31))
        again = queue.enqueue(NewJob("test.noop.v1", job_id="f"))
        assert again.created and again.id != recent.id

    def test_cancelled_job_releases_its_id_at_once(self):
        first = queue.enqueue(NewJob("a.v1", job_id="c"))
        assert queue.cancel([first.id], by="tester") == [first.id]
        again = queue.enqueue(NewJob("a.v1", job_id="c"))
        assert again.created and again.id != first.id


@pytest.mark.django_db(transaction=True)
class TestTransactions:
    def test_rolled_back_transaction_leaves_no_job(self):
        with pytest.raises(RuntimeError), transaction.atomic():
            queue.enqueue(NewJob("a.v1", job_id="rollback"))
            raise RuntimeError("business write failed")
        assert not Job.objects.exists()

    def test_workers_do_not_see_a_job_before_commit(self, threads):
        seen_before_commit = []
        with transaction.atomic():
            queue.enqueue(NewJob("a.v1", job_id="pending"))
            seen_before_commit = threads(
                1, lambda _: queue.claim([ClaimRequest("a.v1", 1)], scope=AllTenants())
            )[0]
        after_commit = queue.claim([ClaimRequest("a.v1", 1)], scope=AllTenants())
        assert seen_before_commit == []
        assert [job.job_id for job in after_commit] == ["pending"]

    def test_twenty_threads_enqueueing_one_job_id_create_one_row(self, threads):
        results = threads(20, lambda i: queue.enqueue(NewJob("a.v1", {"i": i}, job_id="race")))

        assert Job.objects.filter(job_id="race").count() == 1
        assert len({r.id for r in results}) == 1
        assert sum(r.created for r in results) == 1

    def test_batches_sharing_keys_in_opposite_orders_never_deadlock(self, threads):
        """Rows are inserted in key order whatever order a batch gives them in."""
        keys = [f"k{n:02}" for n in range(40)]

        def enqueue_batch(i):
            given = keys if i % 2 else keys[::-1]
            return queue.enqueue_many([NewJob("a.v1", job_id=k) for k in given])

        for _round in range(3):
            Job.objects.all().delete()
            results = threads(6, enqueue_batch)
            assert Job.objects.count() == len(keys)
            assert sum(r.created for batch in results for r in batch) == len(keys)

    def test_concurrent_batches_sharing_keys_never_duplicate(self, threads):
        def enqueue_batch(i):
            keys = [f"k{(i + n) % 10}" for n in range(10)]
            return queue.enqueue_many([NewJob("a.v1", job_id=k) for k in keys])

        results = threads(8, enqueue_batch)

        assert Job.objects.count() == 10
        assert sum(r.created for batch in results for r in batch) == 10

    def test_notify_is_sent_on_commit_for_due_work(self):
        with connection.cursor() as cur:
            cur.execute("LISTEN jobs_enqueued")
        try:
            queue.enqueue_many(
                [NewJob("n.v1"), NewJob("n.v1"), NewJob("m.v1", delay=timedelta(hours=1))]
            )
            pg = connection.connection
            first = [n.payload for n in pg.notifies(timeout=5, stop_after=1)]
            rest = [n.payload for n in pg.notifies(timeout=0.2)]
            # One notification per due name, none for work scheduled later.
            assert first == ["n.v1"]
            assert rest == []
        finally:
            with connection.cursor() as cur:
                cur.execute("UNLISTEN *")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("size", [10_000, 50_000])
def test_a_huge_mixed_tenant_batch_gets_ids_in_exactly_the_given_order(size):
    # Keys in an order that is neither sorted nor reverse-sorted, over two tenants.
    given = [(f"t{n % 3}", f"k{(n * 7919) % size:06}") for n in range(size)]
    results = queue.enqueue_many([NewJob("a.v1", tenant=t, job_id=k) for t, k in given])

    assert [(r.tenant, r.job_id) for r in results] == given
    ids = [r.id for r in results]
    assert ids == sorted(ids) and len(set(ids)) == size
    in_id_order = Job.objects.order_by("id").values_list("tenant", "job_id")
    assert list(in_id_order) == given


@pytest.mark.django_db(transaction=True)
def test_orm_inserts_after_a_batch_draw_from_the_same_sequence_and_never_collide():
    first = queue.enqueue_many([NewJob("a.v1", job_id=f"x{n}") for n in range(50)])
    made = Job.objects.create(name="a.v1", job_id="by-the-orm")
    second = queue.enqueue_many([NewJob("a.v1", job_id=f"y{n}") for n in range(5)])

    assert made.id > max(r.id for r in first)
    assert min(r.id for r in second) > made.id


@pytest.mark.django_db(transaction=True)
def test_rows_inserted_in_a_later_round_share_the_first_rounds_clock_and_keep_delay():
    old = timezone.now() - timedelta(days=30)
    JobFactory(name="a.v1", job_id="late", succeeded=True, finished_at=old)  # expired holder
    batch = [
        NewJob("a.v1", job_id="early"),
        NewJob("a.v1", job_id="late", delay=timedelta(seconds=90)),
        NewJob("a.v1", job_id="early", delay=timedelta(seconds=5)),  # duplicate: the first wins
    ]
    with transaction.atomic():
        results = queue.enqueue_many(batch)
        with connection.cursor() as cur:
            cur.execute("SELECT statement_timestamp(), transaction_timestamp()")
            _, started = cur.fetchone()

    assert [r.created for r in results] == [True, True, False]
    assert results[0].id == results[2].id < results[1].id
    early, late = Job.objects.get(pk=results[0].id), Job.objects.get(pk=results[1].id)
    assert early.created_at == late.created_at >= started
    assert early.run_after == early.created_at
    assert late.run_after == late.created_at + timedelta(seconds=90)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("notify", [True, False])
def test_many_concurrent_batches_sharing_live_expired_and_free_keys_in_any_order(threads, notify):
    keys = [(tenant, f"k{n:03}") for n in range(50) for tenant in ("t1", "t2")]
    with override_settings(JOBS={"NOTIFY": notify}):
        for round_ in range(8):
            Job.objects.all().delete()
            old = timezone.now() - timedelta(days=30)
            live = set()
            for i, (tenant, key) in enumerate(keys):
                if i % 3 == 0:
                    JobFactory(
                        name="a.v1", tenant=tenant, job_id=key, succeeded=True, finished_at=old
                    )
                elif i % 5 == 0:
                    JobFactory(name="a.v1", tenant=tenant, job_id=key)
                    live.add((tenant, key))

            def enqueue_batch(i, round_=round_):
                cut = (i * 17 + round_) % len(keys)
                order = keys[cut:] + keys[:cut]
                if i % 2:
                    order.reverse()
                batch = [NewJob("a.v1", {"i": i}, tenant=t, job_id=k) for t, k in order]
                return order, queue.enqueue_many(batch + batch[:3])  # with duplicates

            results = threads(8, enqueue_batch, timeout=60)

            assert Job.objects.filter(key_held=True).count() == len(keys)
            created = sum(r.created for _, batch in results for r in batch)
            assert created == len(keys) - len(live)
            for order, batch in results:
                assert [(r.tenant, r.job_id) for r in batch[: len(order)]] == order
                mine = [r.id for r in batch[: len(order)] if r.created]
                assert mine == sorted(mine)  # what a batch inserted follows its given order


def _lock_waiters() -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_batches_sharing_keys_do_not_deadlock_when_a_key_is_freed_between_their_rounds(
    monkeypatch,
):
    old = timezone.now() - timedelta(days=30)
    JobFactory(name="a.v1", job_id="k1", succeeded=True, finished_at=old)  # expired holder
    live = JobFactory(name="a.v1", job_id="k2")  # a live holder, cancelled in between

    real_holders = keys_module.holders
    reached = {"A": threading.Event(), "B": threading.Event()}
    proceed = {"A": threading.Event(), "B": threading.Event()}

    def holders(cur, keys):
        me = threading.current_thread().name
        if me in proceed and not reached[me].is_set():  # after the first round only
            reached[me].set()
            assert proceed[me].wait(20)
        return real_holders(cur, keys)

    monkeypatch.setattr(keys_module, "holders", holders)
    errors: dict[str, BaseException] = {}

    def enqueue_both(name: str) -> None:
        try:
            queue.enqueue_many([NewJob("a.v1", job_id="k1"), NewJob("a.v1", job_id="k2")])
        except BaseException as exc:
            errors[name] = exc
        finally:
            connection.close()

    b = threading.Thread(target=enqueue_both, args=("B",), name="B")
    b.start()
    assert reached["B"].wait(10)  # B's first round skipped both keys (both held)
    assert queue.cancel([live.id], by="operator") == [live.id]  # k2 is free now
    a = threading.Thread(target=enqueue_both, args=("A",), name="A")
    a.start()
    assert reached["A"].wait(10)  # A's first round inserted k2 (uncommitted), skipped k1
    proceed["B"].set()  # B releases k1's expired holder, inserts k1, then waits for A on k2
    wait_for(lambda: _lock_waiters() >= 1, what="B to wait for A", interval=0.01)
    proceed["A"].set()  # A releases k1's holder: it waits for B, which waits for A
    a.join(30)
    b.join(30)

    assert not errors, errors  # PostgreSQL ends one of them; that batch is tried again
    assert Job.objects.filter(key_held=True).count() == 2


@pytest.mark.django_db
@override_settings(USE_TZ=False, TIME_ZONE="America/New_York")
def test_due_times_with_use_tz_off_and_a_local_time_zone():
    """With USE_TZ=False the batch insert reads its clock back naive (in the session's zone,
    here New York) and sends it again for the due times: they must still be that clock."""
    queue.enqueue_many([NewJob(name=NAME, payload={}, delay=timedelta(hours=1))] * 2)
    queue.enqueue(NewJob(name=NAME, payload={}, delay=timedelta(hours=1)))
    with connection.cursor() as cur:
        cur.execute(
            "SELECT run_after - created_at, created_at BETWEEN now() AND clock_timestamp() "
            "FROM jobs_job"
        )
        rows = cur.fetchall()
    assert rows == [(timedelta(hours=1), True)] * 3
