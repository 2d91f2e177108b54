"""Releasing the jobs that wait for one that ended: after its outcome, in bounded steps.

The statement that ends a job others wait for records a settlement and nothing more, so its
cost does not grow with the number of jobs waiting; :func:`jobs.queue.dependencies.release`
applies it a step at a time, each edge once, and the worker wakes its release thread as
soon as a pass ends such a job. The settle function leaves the same rows as migration
0013's after random dependency graphs and outcomes (the old one installed in a savepoint on
the same connection), and migrating back and forward keeps settles right on one connection.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Dependency, Job, Settlement
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    dependencies,
    statements,
)
from jobs.queue import batches as queue_batches
from tests.support.keyed_rows import backend, end_one, enqueue_one, insert, state_of
from tests.support.polling import wait_for
from tests.support.worker import Echo, Recorder, registry, running_worker
from tests.support.workflows import settle

UP, DOWN = "test.noop.v1", "test.after.v1"


def claim(name: str = UP, count: int = 100):
    return queue.claim([ClaimRequest(name, count)], scope=AllTenants())


def fan_out(count: int) -> int:
    """A job with ``count`` jobs waiting for it; its id."""
    upstream = queue.enqueue(NewJob(name=UP)).id
    queue.enqueue_many([NewJob(name=DOWN, after=(upstream,)) for _ in range(count)])
    return upstream


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_ending_a_job_fifty_thousand_others_wait_for_is_one_insert():
    """With the old trigger this outcome took over half a second and hit the timeout."""
    upstream = fan_out(50_000)
    [job] = claim(UP)
    with connection.cursor() as cur:
        cur.execute("SET statement_timeout = 300")
    try:
        assert queue.complete(job)
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET statement_timeout")
    # Nothing released yet: the outcome only recorded that there is something to release.
    assert list(Settlement.objects.values_list("upstream", "state")) == [(upstream, "succeeded")]
    assert Job.objects.filter(name=DOWN, waiting_on=1).count() == 50_000

    steps = []
    while (step := dependencies.release(step=20_000)).upstream is not None:
        steps.append((step.settled, step.finished))
    assert steps == [(20_000, False), (20_000, False), (10_000, True)]
    assert Job.objects.filter(name=DOWN, waiting_on=0).count() == 50_000
    assert not Dependency.objects.filter(upstream=upstream, settled=False).exists()
    assert not Settlement.objects.exists()
    assert len(claim(DOWN, 50_000)) == 50_000


@pytest.mark.django_db(transaction=True)
def test_releases_running_at_once_apply_each_edge_once():
    """Two settlements released by two sessions at once; a job waiting for both counts each
    success once, and the step that meets a locked settlement takes the other one."""
    first, second = queue.enqueue(NewJob(name=UP)).id, queue.enqueue(NewJob(name=UP)).id
    both = [queue.enqueue(NewJob(name=DOWN, after=(first, second))).id for _ in range(200)]
    for job in claim(UP):
        assert queue.complete(job)
    assert Settlement.objects.count() == 2
    barrier = threading.Barrier(2)

    def release() -> None:
        try:
            barrier.wait(5)
            while dependencies.release(step=50).upstream is not None:
                pass
        finally:
            connections.close_all()

    threads = [threading.Thread(target=release) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(Job.objects.filter(pk__in=both).values_list("waiting_on", flat=True)) == [0] * 200
    assert not Settlement.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_settlements_of_one_job_apply_in_the_order_it_ended():
    """Failed, replayed, succeeded: its waiting jobs end as it first ended."""
    top = queue.enqueue(NewJob(name=UP)).id
    waiting = queue.enqueue(NewJob(name=DOWN, after=(top,), on_dependency_failure="fail")).id
    [job] = claim(UP)
    queue.fail(job, code="rejected")
    queue.replay([top], by="operator")
    [job] = claim(UP)
    queue.complete(job)
    assert list(Settlement.objects.order_by("id").values_list("state", flat=True)) == [
        "failed",
        "succeeded",
    ]
    while dependencies.release().upstream is not None:
        pass
    assert Job.objects.get(pk=waiting).state == "failed"


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_worker_releases_what_waits_for_a_job_it_ended_and_one_an_operator_cancelled():
    recorder = Recorder()
    with running_worker(registry(recorder)):
        top = queue.enqueue(NewJob(name=Echo.job_name, payload={"text": "top"})).id
        waiting = [
            queue.enqueue(NewJob(name=Echo.job_name, payload={"text": f"w{i}"}, after=(top,))).id
            for i in range(3)
        ]
        wait_for(
            lambda: Job.objects.filter(pk__in=waiting, state="succeeded").count() == 3 or None,
            timeout=10,
            what="the waiting jobs ran after the one they waited for",
            interval=0.005,
        )
        # Ended by an operator, not by a pass: the release thread's own look finds it.
        held = queue.enqueue(
            NewJob(name=Echo.job_name, payload={"text": "later"}, delay=timedelta(hours=1))
        ).id
        doomed = queue.enqueue(
            NewJob(name=Echo.job_name, payload={"text": "doomed"}, after=(held,))
        ).id
        queue.cancel([held], by="operator")
        wait_for(
            lambda: Job.objects.get(pk=doomed).state == "cancelled",
            timeout=10,
            what="the job waiting for a cancelled one was cancelled",
            interval=0.005,
        )


def release_all() -> None:
    while dependencies.release().upstream is not None:
        pass


def state(pk: int) -> tuple[str, int]:
    return Job.objects.filter(pk=pk).values_list("state", "waiting_on").get()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("enqueued", ["after the replay", "replayed with it"])
def test_a_release_pending_from_before_a_replay_leaves_the_jobs_that_wait_for_the_next_run(
    enqueued,
):
    """The job failed and was replayed before its release ran: the jobs that waited for it
    then end; one enqueued after the replay, or itself replayed to wait again, waits on."""
    top = queue.enqueue(NewJob(name=UP)).id
    before = queue.enqueue(NewJob(name=DOWN, after=(top,), on_dependency_failure="fail")).id
    [job] = claim(UP)
    queue.fail(job, code="rejected")
    if enqueued == "after the replay":
        assert queue.replay([top], by="operator").replayed == (top,)
        later = queue.enqueue(NewJob(name=DOWN, after=(top,))).id
    else:
        # The waiting job ended by an earlier failure of another job it waited for, and
        # replayed together with the job whose release is pending.
        other = queue.enqueue(NewJob(name=UP)).id
        later = queue.enqueue(NewJob(name=DOWN, after=(other,))).id
        Job.objects.filter(pk=later).update(
            state="cancelled", key_held=False, waiting_on=0, run_after=Now()
        )
        # It waited for top too (the replay below counts again what it waits for).
        Dependency.objects.create(job=later, upstream=top, on_failure="cancel", settled=True)
        assert queue.replay([top, later], by="operator").replayed == (top, later)
    assert Settlement.objects.filter(upstream=top).exists()
    release_all()
    assert state(before) == ("failed", 0)
    assert state(later)[0] == "queued" and state(later)[1] >= 1


@pytest.mark.django_db(transaction=True)
def test_a_settlement_held_up_by_a_lock_does_not_hold_up_the_others():
    from tests.support.concurrency import Producer

    batch = queue_batches.open(None)
    u1 = queue.enqueue(NewJob(name=UP)).id
    queue_batches.add(batch, [NewJob(name=DOWN, after=(u1,))])
    u2 = queue.enqueue(NewJob(name=UP)).id
    unrelated = queue.enqueue(NewJob(name=DOWN, after=(u2,))).id
    held = {job.id: job for job in claim(UP)}
    queue.fail(held[u1], code="rejected")  # ending its waiting member needs the batch row
    queue.complete(held[u2])
    producer = Producer(lambda: queue_batches.add(batch, [NewJob(name=UP)])).start()
    try:
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = 200")
        with pytest.raises(dependencies.ReleaseFailed):
            dependencies.release_pending()
        assert state(unrelated) == ("queued", 0)
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")
        assert producer.finish() is None
    release_all()
    assert not Settlement.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_release_step_cut_by_the_statement_timeout_is_applied_whole_by_the_next():
    up = fan_out(3000)
    [job] = claim(UP)
    queue.fail(job, code="rejected")
    with connection.cursor() as cur:
        cur.execute("SET statement_timeout = 5")
    try:
        with pytest.raises(dependencies.ReleaseFailed):
            dependencies.release()
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET statement_timeout")
    assert Job.objects.filter(name=DOWN, state="queued", waiting_on=1).count() == 3000
    release_all()
    assert Job.objects.filter(name=DOWN, state="cancelled").count() == 3000
    assert not Settlement.objects.filter(upstream=up).exists()


@pytest.mark.django_db(transaction=True)
def test_a_release_pending_across_migrating_back_and_forward_ends_the_whole_chain():
    """Going back to the tables alone (``migrate jobs 0001``) drops the functions and the
    trigger but keeps the settlement; forward again, the release applies it."""
    from django.core.management import call_command

    top = queue.enqueue(NewJob(name=UP)).id
    mid = queue.enqueue(NewJob(name=DOWN, after=(top,))).id
    bottom = queue.enqueue(NewJob(name=DOWN, after=(mid,))).id
    [job] = claim(UP)
    queue.fail(job, code="rejected")
    assert Settlement.objects.count() == 1
    try:
        call_command("migrate", "jobs", "0001", verbosity=0)
        assert Settlement.objects.count() == 1
    finally:
        call_command("migrate", "jobs", verbosity=0)
    release_all()
    assert [state(mid), state(bottom)] == [("cancelled", 0), ("cancelled", 0)]


def enqueue(name: str = UP, **fields) -> int:
    """Enqueue one job; its dependency checks run as its commit would run them."""
    id_ = queue.enqueue(NewJob(name=name, **fields)).id
    settle()
    return id_


@pytest.mark.django_db
def test_one_success_releases_a_thousand_waiting_jobs_at_once():
    top = enqueue()
    waiting = [r.id for r in queue.enqueue_many([NewJob(name=DOWN, after=(top,))] * 1000)]
    assert Job.objects.filter(pk__in=waiting, waiting_on=1).count() == 1000
    [job] = claim()
    assert queue.complete(job)
    settle()  # the release after the outcome
    assert len(claim(DOWN, 2000)) == 1000


# The trigger function that settled waiting jobs in the statement (0010 to 0024).


# 0013's definition of the settle function, as that migration wrote it.


def settle_source(function: str = "jobs_dependents_release") -> str | None:
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [function])
        row = cur.fetchone()
    return None if row is None else row[0]


def _release_body() -> str:
    """The text of ``jobs_dependents_release`` between its dollar quotes, in its file."""
    return (
        (statements.FOLDER / "functions" / "jobs_dependents_release.sql").read_text().split("$$")[1]
    )


dag_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 10), max_size=3), st.sampled_from(["cancel", "fail"])),
    min_size=2,
    max_size=7,
)


steps_strategy = st.lists(
    st.tuples(st.integers(0, 6), st.sampled_from(["succeeded", "failed", "cancelled"])),
    min_size=1,
    max_size=6,
)


@pytest.mark.django_db
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(dag=dag_strategy, steps=steps_strategy)
def test_the_release_settles_any_graph_and_outcomes_as_the_rules_say(dag, steps):
    """Each job waits for some earlier ones; jobs due to run end one after another, the
    release settling what waits for them after each: the rows are the model's."""
    with transaction.atomic(), connection.cursor() as cur:
        ups = [sorted({u % j for u in wanted}) if j else [] for j, (wanted, _) in enumerate(dag)]
        waited = {u for each in ups for u in each}
        ids: list[int] = []
        for j, upstreams in enumerate(ups):
            ids.append(
                insert(
                    cur,
                    f"dag-{j}",
                    "queued",
                    held=True,
                    waiting=len(upstreams),
                    depended_on=j in waited,
                )
            )
        for j, upstreams in enumerate(ups):
            for u in upstreams:
                cur.execute(
                    "INSERT INTO jobs_dependency (job, upstream, on_failure) VALUES (%s, %s, %s)",
                    [ids[j], ids[u], dag[j][1]],
                )
        for index, state in steps:
            cur.execute(
                "UPDATE jobs_job SET state = %(state)s, finished_at = statement_timestamp(), "
                "key_held = %(state)s <> 'cancelled' "
                "WHERE id = %(id)s AND state = 'queued' AND waiting_on = 0",
                {"state": state, "id": ids[index % len(ids)]},
            )
            settle()
        cur.execute(
            "SELECT id, state, waiting_on, key_held, last_error, error_detail, "
            "run_after IS NULL, finished_at IS NULL FROM jobs_job ORDER BY id"
        )
        assert cur.fetchall() == _settled_as_the_rules_say(ids, ups, dag, steps)
        transaction.set_rollback(True)


def _settled_as_the_rules_say(
    ids: list[int], ups: list[list[int]], dag: list[tuple[list[int], str]], steps: list
) -> list[tuple]:
    """The rows the settle rules leave. A job that ends, if others wait for it, settles them
    after it, each edge once, the lowest ended job first: a success takes one off each waiting
    job's count (due now at none); a failure or cancel ends each waiting job as its edge says
    (``fail``: failed, holding its key; ``cancel``: cancelled), and those settle in turn."""
    n = len(ids)
    row = [
        {
            "state": "queued",
            "waiting": len(ups[j]),
            "held": True,
            "error": "",
            "detail": "",
            "until": bool(ups[j]),
            "open": True,
        }
        for j in range(n)
    ]
    waited = {u for each in ups for u in each}
    settled: set[tuple[int, int]] = set()
    pending: list[tuple[int, str]] = []
    for index, state in steps:
        j = index % n
        if row[j]["state"] == "queued" and row[j]["waiting"] == 0:
            row[j].update(state=state, held=state != "cancelled", open=False)
            if j in waited:
                pending.append((j, state))
        while pending:
            pending.sort()
            up, ended = pending.pop(0)
            for d in (d for d in range(n) if up in ups[d] and (d, up) not in settled):
                settled.add((d, up))
                if row[d]["state"] != "queued" or row[d]["waiting"] == 0:
                    continue
                if ended == "succeeded":
                    row[d]["waiting"] -= 1
                    row[d]["until"] = row[d]["waiting"] > 0
                    continue
                fail = dag[d][1] == "fail"
                row[d].update(
                    state="failed" if fail else "cancelled",
                    held=fail,
                    waiting=0,
                    until=False,
                    open=False,
                    error="dependency_failed",
                    detail=f"job {ids[up]}, which this job waited for, ended {ended}",
                )
                if d in waited:
                    pending.append((d, row[d]["state"]))
    return [
        (
            ids[j],
            r["state"],
            r["waiting"],
            r["held"],
            r["error"],
            r["detail"],
            r["until"],
            r["open"],
        )
        for j, r in enumerate(row)
    ]


def _settles_each_way() -> None:
    """Success lets waiting jobs go (a diamond one at a time), failure ends the chain below."""
    first, second = enqueue_one(job_id="first"), enqueue_one(job_id="second")
    both = enqueue_one(DOWN, after=(first, second))
    below = enqueue_one(DOWN, after=(both,), on_dependency_failure="fail")
    end_one(UP, "succeeded")
    assert state_of(both)[:2] == ("queued", 1)
    end_one(UP, "succeeded")
    assert state_of(both)[:2] == ("queued", 0)
    assert Job.objects.get(pk=both).run_after <= database_now()
    assert state_of(below)[:2] == ("queued", 1)

    top = enqueue_one(job_id="top")
    left = enqueue_one(DOWN, after=(top,))  # cancel edge
    right = enqueue_one(DOWN, after=(top,), on_dependency_failure="fail")
    bottom = enqueue_one(DOWN, after=(left, right), on_dependency_failure="fail")
    end_one(UP, "failed")
    # Keyless, none of them holds a key.
    assert state_of(left) == ("cancelled", 0, False, "dependency_failed")
    assert state_of(right) == ("failed", 0, False, "dependency_failed")
    # Reached by two paths, ended once, by the lowest upstream's edge (left ended cancelled).
    assert state_of(bottom) == ("failed", 0, False, "dependency_failed")
    assert Job.objects.get(pk=bottom).error_detail == (
        f"job {left}, which this job waited for, ended cancelled"
    )
    assert state_of(both)[:2] == ("queued", 0)  # untouched by the other chain
    Job.objects.filter(name__in=[UP, DOWN]).delete()


@pytest.mark.django_db(transaction=True)
def test_settles_are_right_before_across_and_after_migrating_back_to_0001_and_forward():
    """On one connection: settles by the release (its plan kept), ``migrate jobs 0001`` (the
    functions and the trigger dropped), ``migrate`` forward (made anew), settles by the
    release again; the function's text is its file's, in effect at once on the connection
    that ran the one before."""
    pid = backend()
    _settles_each_way()
    assert settle_source() == _release_body()
    try:
        call_command("migrate", "jobs", "0001", verbosity=0)
        assert backend() == pid
        assert settle_source() is None
    finally:
        call_command("migrate", "jobs", verbosity=0)
    assert backend() == pid
    assert settle_source() == _release_body()
    _settles_each_way()
