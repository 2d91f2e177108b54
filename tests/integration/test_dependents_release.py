"""Releasing the jobs that wait for one that ended: after its outcome, in bounded steps.

The statement that ends a job others wait for records a settlement and nothing more, so its
cost does not grow with the number of jobs waiting; :func:`jobs.queue.dependencies.release`
applies it a step at a time, each edge once, and the worker wakes its release thread as
soon as a pass ends such a job.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections

from jobs import queue
from jobs.models import Dependency, Job, Settlement
from jobs.queue import AllTenants, ClaimRequest, NewJob, dependencies
from tests.worker_support import Echo, Recorder, registry, running_worker, wait_for

UP, DOWN = "test.noop.v1", "test.after.v1"


def claim(name: str, count: int = 100):
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
        )
