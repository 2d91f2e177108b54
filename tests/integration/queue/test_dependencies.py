"""Jobs that wait for others: claimed only after they all succeed, ended when one fails."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Dependency, Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob, history
from jobs.queue.types import InvalidJob
from tests.support.workflows import settle

UP, DOWN = "test.noop.v1", "test.after.v1"


def enqueue(name: str = UP, **fields) -> int:
    """Enqueue one job and settle, as its commit would (the tests run in one transaction)."""
    id_ = queue.enqueue(NewJob(name=name, **fields)).id
    settle()
    return id_


def complete(job) -> None:
    """Complete a claimed job, then release what waits for it, as the worker would."""
    queue.complete(job)
    settle()


def fail(job, **fields) -> None:
    """Fail a claimed job, then release what waits for it, as the worker would."""
    queue.fail(job, **fields)
    settle()


def claim(name: str = UP, count: int = 100):
    return queue.claim([ClaimRequest(name, count)], scope=AllTenants())


def row(id_: int) -> Job:
    return Job.objects.get(pk=id_)


@pytest.mark.django_db
def test_a_waiting_job_is_claimed_only_after_every_job_it_waits_for_succeeded():
    first, second = enqueue(), enqueue()
    waiting = enqueue(DOWN, after=(first, second))
    assert (row(waiting).waiting_on, row(waiting).run_after) == (2, None)
    assert row(first).depended_on and not row(waiting).depended_on
    a, b = claim(UP)
    assert claim(DOWN) == []
    complete(a)
    assert row(waiting).waiting_on == 1 and claim(DOWN) == []
    complete(b)
    assert row(waiting).waiting_on == 0
    [job] = claim(DOWN)
    assert job.id == waiting


@pytest.mark.django_db
@pytest.mark.parametrize(("policy", "state"), [("cancel", "cancelled"), ("fail", "failed")])
def test_a_failure_ends_the_waiting_jobs_down_the_chain(policy, state):
    top = enqueue()
    middle = enqueue(DOWN, after=(top,), on_dependency_failure=policy)
    bottom = enqueue(DOWN, after=(middle,))
    [job] = claim(UP)
    fail(job, code="rejected", detail="no")
    assert (row(middle).state, row(middle).last_error) == (state, "dependency_failed")
    assert f"job {top}" in row(middle).error_detail
    assert row(bottom).state == "cancelled"
    assert claim(DOWN) == []


@pytest.mark.django_db
def test_a_retry_of_the_job_waited_for_keeps_the_waiting_job_waiting():
    top = enqueue()
    waiting = enqueue(DOWN, after=(top,))
    [job] = claim(UP)
    queue.retry(job, code="handler_error")
    assert (row(waiting).state, row(waiting).waiting_on) == ("queued", 1)


@pytest.mark.django_db
def test_jobs_finished_already_are_reckoned_at_enqueue():
    done = enqueue()
    [job] = claim(UP)
    complete(job)
    released = enqueue(DOWN, after=(done,))
    assert row(released).waiting_on == 0
    assert [j.id for j in claim(DOWN)] == [released]

    failed = enqueue()
    [job] = claim(UP)
    fail(job, code="rejected")
    ended = enqueue(DOWN, after=(failed,))
    assert (row(ended).state, row(ended).last_error) == ("cancelled", "dependency_failed")


@pytest.mark.django_db
def test_job_ids_name_the_key_holder_and_unknown_jobs_are_refused():
    by_key = enqueue(job_id="import-7")
    waiting = enqueue(DOWN, after=("import-7",))
    assert list(Dependency.objects.filter(job=waiting).values_list("upstream", flat=True)) == [
        by_key
    ]
    with pytest.raises(InvalidJob, match="no job holds job_id 'nope'"):
        enqueue(DOWN, after=("nope",))
    with pytest.raises(InvalidJob, match="no job has row id 999999"):
        enqueue(DOWN, after=(999999,))
    assert Job.objects.filter(name=DOWN).count() == 1  # the refused ones left nothing


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"after": 5}, "after must be a list"),
        ({"after": (True,)}, "row ids"),
        ({"after": (0,)}, "not a job row id"),
        ({"after": ("",)}, "1-255 characters"),
        ({"after": (1,), "delay": __import__("datetime").timedelta(seconds=1)}, "not both"),
        ({"after": (1,), "on_dependency_failure": "ignore"}, "on_dependency_failure"),
        ({"after": tuple(range(1, 1002))}, "at most 1,000"),
    ],
)
def test_bad_dependencies_are_refused(fields, message):
    with pytest.raises(InvalidJob, match=message):
        enqueue(DOWN, **fields)


@pytest.mark.django_db
def test_run_now_does_not_release_a_waiting_job_and_replay_waits_again():
    top = enqueue()
    waiting = enqueue(DOWN, after=(top,), on_dependency_failure="fail")
    assert queue.run_now([waiting]) == []
    [job] = claim(UP)
    fail(job, code="rejected")
    assert row(waiting).state == "failed"
    # Replaying the job waited for, then the waiting one: it waits again, then runs.
    queue.replay([top], by="operator")
    queue.replay([waiting], by="operator")
    settle()
    assert (row(waiting).state, row(waiting).waiting_on) == ("queued", 1)
    assert claim(DOWN) == []
    [job] = claim(UP)
    complete(job)
    assert [j.id for j in claim(DOWN)] == [waiting]


@pytest.mark.django_db
def test_replaying_a_waiting_job_whose_dependency_still_failed_ends_it_again():
    top = enqueue()
    waiting = enqueue(DOWN, after=(top,), on_dependency_failure="fail")
    [job] = claim(UP)
    fail(job, code="rejected")
    queue.replay([waiting], by="operator")
    settle()
    assert (row(waiting).state, row(waiting).last_error) == ("failed", "dependency_failed")


@pytest.mark.django_db
def test_a_job_cancelled_while_it_waited_replays_from_the_history_and_runs():
    top = enqueue()
    waiting = enqueue(DOWN, after=(top,))
    assert queue.cancel([waiting], by="operator") == [waiting]
    history.archive(now=database_now() + timedelta(minutes=1))
    assert not Job.objects.filter(pk=waiting).exists()
    assert JobHistory.objects.get(pk=waiting).run_after is None  # it never became due
    # Its edge left with it: replayed, it waits for nothing and is due at once.
    assert queue.replay([waiting], by="operator").replayed == (waiting,)
    assert (row(waiting).state, row(waiting).waiting_on) == ("queued", 0)
    assert [j.id for j in claim(DOWN)] == [waiting]


@pytest.mark.django_db(transaction=True)
def test_no_waiting_job_misses_a_job_that_finishes_while_it_is_enqueued(threads):
    """Enqueue of the waiting job and the outcome of the job it waits for, at one instant."""
    for _round in range(15):
        tops = [enqueue() for _ in range(4)]
        held = {job.id: job for job in claim(UP)}

        def act(index: int, tops=tops, held=held):
            if index < 4:
                # A row locked by the enqueue is "busy" to the outcome write, which the worker
                # writes again later: do the same until it is applied.
                while not queue.complete(held[tops[index]]):
                    pass
                return None
            return enqueue(DOWN, after=(tops[index - 4],))

        waiting = threads(8, act)[4:]
        settle()  # what the worker's release thread does after the outcomes
        for id_ in waiting:
            assert row(id_).waiting_on == 0, "a waiting job missed the success it waited for"
        assert sorted(j.id for j in claim(DOWN)) == sorted(waiting)


@pytest.mark.django_db
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    graph=st.lists(st.lists(st.integers(0, 30), max_size=3), min_size=1, max_size=8),
    outcomes=st.lists(st.sampled_from(["complete", "fail"]), min_size=8, max_size=8),
)
def test_a_job_runs_only_after_all_it_waits_for_succeeded(graph, outcomes):
    """Any DAG (each job waits for some earlier ones), any outcomes, in claim order."""
    from django.db import transaction

    with transaction.atomic():
        sid = transaction.savepoint()
        try:
            ids: list[int] = []
            for index, picks in enumerate(graph):
                after = tuple(dict.fromkeys(ids[p % index] for p in picks)) if index else ()
                ids.append(enqueue(UP, after=after))
            ended: dict[int, str] = {}
            step = 0
            while claimed := claim(UP, 1):
                [job] = claimed
                edges = Dependency.objects.filter(job=job.id).values_list("upstream", flat=True)
                assert all(ended.get(up) == "succeeded" for up in edges)
                outcome = outcomes[step % len(outcomes)]
                step += 1
                if outcome == "complete":
                    complete(job)
                else:
                    fail(job, code="rejected")
                ended[job.id] = "succeeded" if outcome == "complete" else "failed"
            for id_ in ids:
                job = row(id_)
                edges = list(Dependency.objects.filter(job=id_).values_list("upstream", flat=True))
                if job.state == "cancelled":
                    assert any(row(up).state != "succeeded" for up in edges)
                else:
                    assert job.state in ("succeeded", "failed")
        finally:
            transaction.savepoint_rollback(sid)


@pytest.mark.django_db
def test_a_type_bound_to_a_run_table_cannot_wait():
    import jobs
    from tests.runapp.jobs import DeliverV1

    top = enqueue()
    with pytest.raises(InvalidJob, match="bound to a run table"):
        jobs.enqueue(DeliverV1(run_id=1), after=[top])


def chain(length: int, **head_fields) -> tuple[int, int]:
    """A head job and ``length`` jobs each waiting for the one before; (head, tail)."""
    head = prev = enqueue(**head_fields)
    for _ in range(length):
        prev = enqueue(DOWN, after=(prev,))
    return head, prev


@pytest.mark.django_db
@pytest.mark.parametrize("end", ["fail", "cancel"])
def test_a_failure_at_the_head_of_a_long_chain_ends_the_whole_chain(end):
    head, tail = chain(500)
    if end == "fail":
        [job] = claim()
        assert queue.fail(job, code="rejected")
    else:
        assert queue.cancel([head], by="operator") == [head]
    settle()  # the release after the head ended, to the end of the chain
    assert Job.objects.get(pk=tail).state == "cancelled"
    assert Job.objects.get(pk=tail).last_error == "dependency_failed"


@pytest.mark.django_db
def test_an_exhausted_chain_head_does_not_wedge_the_exhaustion_pass_for_others():
    head, _tail = chain(500, max_attempts=1)
    unrelated = enqueue(max_attempts=1)
    assert len(claim()) == 2
    Job.objects.filter(pk__in=[head, unrelated]).update(
        lease_expires_at=timezone.now() - timedelta(minutes=1)
    )
    try:
        with transaction.atomic():
            queue.fail_exhausted()
    except OperationalError:
        pass  # the head's own failure may be refused; the unrelated job's must not be
    assert Job.objects.get(pk=unrelated).state == "failed"


@pytest.mark.django_db
def test_after_a_job_id_whose_holder_window_has_passed_is_not_its_old_success():
    # A holder whose window has passed lets its key go to the next job enqueued under it:
    # waiting for its weeks-old success would wait for the wrong job. The name is refused
    # (after= names jobs enqueued before the call; a job of the same call by its result).
    old = enqueue(job_id="render-42")
    [job] = claim()
    queue.complete(job)
    Job.objects.filter(pk=old).update(finished_at=timezone.now() - timedelta(days=30))
    with pytest.raises(InvalidJob, match="no job holds job_id 'render-42'"):
        queue.enqueue_many(
            [NewJob(name=UP, job_id="render-42"), NewJob(name=DOWN, after=("render-42",))]
        )
    assert not Job.objects.filter(name=DOWN).exists()
    render = queue.enqueue(NewJob(name=UP, job_id="render-42"))
    assert render.created and render.id != old
    publish = queue.enqueue(NewJob(name=DOWN, after=("render-42",)))
    assert Job.objects.get(pk=publish.id).waiting_on == 1


@pytest.mark.django_db
def test_after_refuses_a_row_id_of_another_tenant():
    other = enqueue(tenant="tenant-b")
    with pytest.raises(InvalidJob):
        enqueue(DOWN, tenant="tenant-a", after=(other,))


@pytest.mark.django_db
def test_after_names_a_keyless_job_by_its_id_and_says_so_for_its_generated_job_id():
    """A job enqueued without a job_id holds no key, so its generated job_id names nothing."""
    upstream = queue.enqueue(NewJob(name=UP))
    waiting = queue.enqueue(NewJob(name=DOWN, after=(upstream.id,)))
    assert waiting.created
    with pytest.raises(InvalidJob, match=r"enqueued without a job_id.*by its id"):
        queue.enqueue(NewJob(name=DOWN, after=(upstream.job_id,)))
