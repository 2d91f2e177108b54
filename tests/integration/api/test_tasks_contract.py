"""What Django's documentation promises of a task backend and a ``TaskResult``, on this one.

Each behaviour runs through the real worker (``jobs.testing.run_worker``, or a worker thread
for what can only be seen while a task runs). Where the backend deliberately differs from
Django's reference database backend (attempts are retried; ids are the job's number), the
difference is pinned here and written down in docs/tasks.md.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.tasks import TaskResultStatus, default_task_backend, task
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jobs.backends import PostgresBackend
from jobs.catalogue.registry import get_registry
from jobs.models import Job
from jobs.testing import JobFailed, run_worker
from tests.jobapp import tasks
from tests.support.polling import wait_for
from tests.support.tasks_backend import backend_settings, make_due, one_attempt, received
from tests.support.worker import running_worker

pytestmark = pytest.mark.django_db(transaction=True)


def _closing_connections(coroutine_function):
    """Run an async test body; close the connections asgiref's thread opened for it."""

    async def body():
        try:
            return await coroutine_function()
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(body())


# -- enqueue: a READY result of the task exactly as it was enqueued ------------------------


def test_enqueue_returns_a_ready_result_of_the_task_as_enqueued():
    with received(task_enqueued) as enqueued:
        result = tasks.add.enqueue(1, b=2)

    assert result.status == TaskResultStatus.READY
    assert not result.is_finished
    assert result.enqueued_at is not None
    assert (result.started_at, result.last_attempted_at, result.finished_at) == (None,) * 3
    assert (result.errors, result.worker_ids, result.attempts) == ([], [], 0)
    assert (result.args, result.kwargs, result.backend) == ([1], {"b": 2}, "default")
    assert result.task == tasks.add
    assert isinstance(result.id, str) and len(result.id) < 64
    with pytest.raises(ValueError, match=r"^Task has not finished yet$"):
        _ = result.return_value
    assert enqueued == [(PostgresBackend, result)]
    assert default_task_backend.get_result(result.id) == result

    run_worker()

    assert tasks.add.get_result(result.id).return_value == 3


def test_the_result_task_is_the_task_as_enqueued_after_every_attempt(tmp_path):
    """``result.task.run_after`` is what was asked for: None, or the given time; never the
    time a retry was scheduled for."""
    asked = timezone.now() - timedelta(minutes=5)
    plain = tasks.retries_later.enqueue(str(tmp_path / "plain"))
    deferred = tasks.retries_later.using(run_after=asked).enqueue(str(tmp_path / "deferred"))

    assert plain.task == tasks.retries_later and plain.task.run_after is None
    assert deferred.task == tasks.retries_later.using(run_after=asked)
    run_worker()  # both go back to the queue for an hour

    for result, run_after in ((plain, None), (deferred, asked)):
        result.refresh()
        assert result.status == TaskResultStatus.READY and result.attempts == 1
        again = default_task_backend.get_result(result.id)
        assert again.task.run_after == run_after
        assert again.task == result.task
        make_due(result.id)
    run_worker()

    assert tasks.retries_later.get_result(plain.id).task == tasks.retries_later
    assert tasks.retries_later.get_result(deferred.id).task.run_after == asked


def test_run_after_defers_the_task_until_then():
    later = timezone.now() + timedelta(hours=1)
    result = tasks.add.using(run_after=later).enqueue(1, 1)

    run_worker(timeout=1)

    result.refresh()
    assert result.status == TaskResultStatus.READY and result.attempts == 0
    assert result.task.run_after == later
    make_due(result.id)
    run_worker()
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 2)
    assert result.task.run_after == later
    assert result.started_at >= result.enqueued_at


# -- a run: status, times, worker ids, return value ---------------------------------------


def test_a_successful_run_reports_its_times_worker_and_return_value():
    result = tasks.add.enqueue(2, 3)

    with running_worker(get_registry(), identity="contract-worker"):
        wait_for(
            lambda: default_task_backend.get_result(result.id).is_finished,
            what="task finished",
            interval=0.005,
        )

    assert result.status == TaskResultStatus.READY  # a result changes only when refreshed
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.is_finished
    assert result.return_value == 5
    assert result.worker_ids == ["contract-worker"] and result.attempts == 1
    assert result.errors == []
    assert result.started_at == result.last_attempted_at
    assert result.enqueued_at <= result.started_at <= result.finished_at


def test_the_status_is_running_while_the_task_runs():
    gate = tasks.gate("running")
    gate.clear()
    result = tasks.blocks.enqueue("running")

    with running_worker(get_registry(), identity="runner"):
        running = wait_for(
            lambda: (r := default_task_backend.get_result(result.id)).status == "RUNNING" and r,
            what="task running",
            interval=0.005,
        )
        assert not running.is_finished
        assert running.started_at is not None and running.finished_at is None
        assert running.last_attempted_at == running.started_at
        # The running attempt is counted, as Django's backends count it (TaskContext.attempt
        # starts at 1).
        assert (running.worker_ids, running.attempts) == (["runner"], 1)
        with pytest.raises(ValueError, match=r"^Task has not finished yet$"):
            _ = running.return_value
        gate.set()
        wait_for(
            lambda: default_task_backend.get_result(result.id).is_finished,
            what="done",
            interval=0.005,
        )

    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "running")


def test_a_failed_task_reports_its_error_and_no_return_value():
    with one_attempt():
        result = tasks.fails.enqueue("no luck")
        with pytest.raises(JobFailed):
            run_worker()

        result.refresh()

    assert result.status == TaskResultStatus.FAILED and result.is_finished
    assert result.finished_at >= result.started_at
    with pytest.raises(ValueError, match=r"^Task failed$"):
        _ = result.return_value
    [error] = result.errors
    assert error.exception_class is ValueError
    assert error.exception_class_path == "builtins.ValueError"


def test_the_traceback_is_the_one_python_formats():
    """The traceback ends, as Python writes it, with the exception line and its newline; the
    frames the ``task_finished`` signal saw (the task's own) are its last frames."""
    with one_attempt(), received(task_finished) as finished:
        result = tasks.fails.enqueue("formatted")
        with pytest.raises(JobFailed):
            run_worker()
        result.refresh()

    [error] = result.errors
    assert error.traceback.startswith("Traceback (most recent call last):\n")
    assert error.traceback.endswith("\nValueError: formatted\n")
    [(_, sent)] = finished
    frames = sent.errors[-1].traceback.partition("Traceback (most recent call last):\n")[2]
    assert frames and error.traceback.endswith(frames)


def test_the_traceback_of_an_exception_group_keeps_its_margin():
    """An exception group's traceback starts with its two-space margin, as Python prints it."""
    with one_attempt():
        result = tasks.raises_group.enqueue()
        with pytest.raises(JobFailed):
            run_worker()

    [error] = tasks.raises_group.get_result(result.id).errors
    assert error.exception_class is ExceptionGroup
    assert error.traceback.startswith("  + Exception Group Traceback (most recent call last):\n")
    assert error.traceback.endswith("\n")


# -- exceptions that end the task at once still name their own class -----------------------


@pytest.mark.parametrize(
    ("the_task", "kind", "last_line"),
    [
        (
            tasks.returns_datetime,
            TypeError,
            "TypeError: tests.jobapp.tasks.returns_datetime returned a value that is not "
            "JSON: result: datetime.datetime is not a JSON type",
        ),
        (
            tasks.returns_set,
            TypeError,
            "TypeError: tests.jobapp.tasks.returns_set returned a value that is not JSON: "
            "result: set is not a JSON type",
        ),
        (
            tasks.returns_nan,
            ValueError,
            "ValueError: tests.jobapp.tasks.returns_nan returned a value that is not JSON: "
            "result['ratio']: nan is not a JSON number",
        ),
        (tasks.exits, SystemExit, "SystemExit: 3"),
        (tasks.interrupts, KeyboardInterrupt, "KeyboardInterrupt"),
    ],
    ids=["datetime", "set", "nan", "SystemExit", "KeyboardInterrupt"],
)
def test_what_no_retry_can_fix_fails_at_once_under_its_own_class(the_task, kind, last_line):
    result = the_task.enqueue()  # MAX_ATTEMPTS is 5: only the classification stops a retry

    with pytest.raises(JobFailed) as failed:
        run_worker(timeout=5)

    assert failed.value.code == "rejected"
    result.refresh()
    assert (result.status, result.attempts) == (TaskResultStatus.FAILED, 1)
    [error] = result.errors
    assert error.exception_class is kind
    assert error.exception_class_path == f"builtins.{kind.__name__}"
    assert f"\n{last_line}\n" in error.traceback
    assert error.traceback.endswith("the task fails without a retry\n")
    with pytest.raises(ValueError, match=r"^Task failed$"):
        _ = result.return_value


# -- retries: a deliberate difference from Django's reference database backend ------------


def test_a_failed_attempt_is_retried_and_every_attempt_is_reported(tmp_path):
    """Django's reference backends run a task once; this one retries its exceptions (docs/
    tasks.md). Between attempts the result is READY with the error of the attempt before;
    ``started_at`` stays the first attempt's start, ``last_attempted_at`` moves on."""
    result = tasks.retries_later.enqueue(str(tmp_path / "marker"))

    run_worker()

    result.refresh()
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert result.finished_at is None
    assert result.attempts == 1 and len(result.worker_ids) == 1
    [error] = result.errors
    assert error.exception_class_path == "jobs.errors.RetryAfter"
    assert error.traceback.endswith("jobs.errors.RetryAfter: come back in an hour\n")
    with pytest.raises(ValueError, match=r"^Task has not finished yet$"):
        _ = result.return_value
    first_start = result.started_at
    assert first_start is not None and result.last_attempted_at == first_start

    make_due(result.id)
    run_worker()

    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "done")
    assert result.attempts == 2 and len(result.errors) == 1
    assert result.started_at == first_start
    assert result.last_attempted_at > first_start
    assert result.finished_at >= result.last_attempted_at


def test_a_task_that_fails_on_every_attempt_lists_one_error_per_attempt():
    with backend_settings(MAX_ATTEMPTS=2):
        result = tasks.fails.enqueue("again")
        with pytest.raises(JobFailed):
            run_worker()

    result.refresh()
    assert (result.status, result.attempts) == (TaskResultStatus.FAILED, 2)
    assert [e.exception_class for e in result.errors] == [ValueError, ValueError]
    assert all(e.traceback.endswith("ValueError: again\n") for e in result.errors)
    assert result.started_at < result.last_attempted_at <= result.finished_at


# -- takes_context: TaskContext.task_result and TaskContext.attempt ------------------------


def test_a_task_that_takes_context_sees_its_running_result_and_attempt(tmp_path):
    marker = tmp_path / "context"
    result = tasks.reports_its_context.enqueue(str(marker))

    run_worker()
    make_due(result.id)
    run_worker()

    result.refresh()
    expected = {
        "id": result.id,
        "status": TaskResultStatus.RUNNING,
        "args": [str(marker)],
        "task": "tests.jobapp.tasks.reports_its_context",
        "started": True,
        "is_task_context": True,
    }
    first = {**expected, "attempt": 1, "attempts": 1, "workers": 1}
    assert result.return_value == {
        "first": first,
        "second": {**expected, "attempt": 2, "attempts": 2, "workers": 2},
    }


def test_the_signals_and_django_s_log_lines_follow_the_run(caplog):
    with (
        received(task_enqueued) as enqueued,
        received(task_started) as started,
        received(task_finished) as finished,
        caplog.at_level("DEBUG", logger="django.tasks"),
    ):
        result = tasks.add.enqueue(1, 1)
        run_worker()

    sent = [*enqueued, *started, *finished]
    assert [sender for sender, _ in sent] == [PostgresBackend] * 3
    assert [r.id for _, r in sent] == [result.id] * 3
    assert [r.status for _, r in sent] == ["READY", "RUNNING", "SUCCESSFUL"]
    lines = [r.getMessage() for r in caplog.records if r.name == "django.tasks"]
    assert [line.partition(f"id={result.id} ")[2].split()[-1] for line in lines] == [
        "backend=default",
        "state=RUNNING",
        "state=SUCCESSFUL",
    ]


# -- priorities and queues ----------------------------------------------------------------


def test_higher_priorities_run_first():
    low = tasks.add.using(priority=-10).enqueue(0, 1)
    normal = tasks.add.enqueue(0, 2)
    high = tasks.add.using(priority=100).enqueue(0, 3)

    run_worker(concurrency=1)

    started = {
        name: default_task_backend.get_result(r.id).started_at
        for name, r in (("low", low), ("normal", normal), ("high", high))
    }
    assert sorted(started, key=started.__getitem__) == ["high", "normal", "low"]
    assert default_task_backend.get_result(high.id).task.priority == 100


def test_a_task_runs_on_the_queue_it_names():
    with backend_settings(QUEUES=["default", "bulk"]):
        result = tasks.add.using(queue_name="bulk").enqueue(4, 4)

        assert Job.objects.get(pk=int(result.id)).queue == "bulk"
        assert result.task.queue_name == "bulk"
        assert result.task == tasks.add.using(queue_name="bulk")
        run_worker()

        assert tasks.add.using(queue_name="bulk").get_result(result.id).return_value == 8


# -- validation: InvalidTask, Django's messages, nothing stored ----------------------------


def _module_level_only(): ...


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tasks.add.using(priority=101), "priority must be a whole number between"),
        (lambda: tasks.add.using(priority=-101), "priority must be a whole number between"),
        (lambda: tasks.add.using(priority=1.5), "priority must be a whole number between"),
        (
            lambda: tasks.add.using(run_after=timezone.now().replace(tzinfo=None)),
            "run_after must be an aware datetime.",
        ),
        (lambda: tasks.add.using(queue_name="nope"), "Queue 'nope' is not valid for backend."),
        (
            lambda: task(takes_context=True)(_module_level_only),
            "Task takes context but does not have a first argument of 'context'.",
        ),
        (lambda: task(lambda: None), "Task function must be defined at a module level."),
    ],
    ids=["over-100", "under-100", "fraction", "naive", "queue", "context", "lambda"],
)
def test_an_invalid_task_is_refused_with_django_s_message(make, message):
    with pytest.raises(InvalidTask) as refused:
        make()

    assert str(refused.value).startswith(message)
    assert not Job.objects.exists()


@pytest.mark.parametrize("name", ["with space", "", "x" * 65, "-leading-dash", "ünïcode"])
def test_a_queue_name_the_jobs_table_cannot_hold_is_an_invalid_task(name):
    """With ``QUEUES = []`` Django lets any queue name through; this backend still needs one
    the jobs table can hold, and says so as Django does: InvalidTask, before anything is
    stored."""
    with backend_settings(QUEUES=[]):
        assert tasks.add.using(queue_name="any-name.v2:ok").enqueue(1, 1).task.queue_name
        with pytest.raises(InvalidTask, match=r"^Queue .* is not valid for backend: "):
            tasks.add.using(queue_name=name)
    assert Job.objects.count() == 1


# -- get_result, refresh and their async twins ---------------------------------------------


def test_refresh_and_arefresh_reload_what_the_worker_wrote():
    result = tasks.add.enqueue(20, 22)
    twin = default_task_backend.get_result(result.id)

    run_worker()

    result.refresh()
    _closing_connections(twin.arefresh)
    for refreshed in (result, twin):
        assert refreshed.status == TaskResultStatus.SUCCESSFUL
        assert refreshed.return_value == 42
        assert refreshed.attempts == 1
    assert result == twin == default_task_backend.get_result(result.id)


def test_aenqueue_and_aget_result():
    async def enqueue_then_read():
        enqueued = await tasks.add.aenqueue(5, 6)
        return enqueued, await tasks.add.aget_result(enqueued.id)

    enqueued, read = _closing_connections(enqueue_then_read)

    assert read == enqueued and read.status == TaskResultStatus.READY
    run_worker()

    async def read_again():
        return await default_task_backend.aget_result(enqueued.id)

    done = _closing_connections(read_again)
    assert (done.status, done.return_value) == (TaskResultStatus.SUCCESSFUL, 11)


def test_get_result_of_another_task_is_a_mismatch():
    result = tasks.add.enqueue(1, 2)

    with pytest.raises(TaskResultMismatch):
        tasks.urgent.get_result(result.id)

    async def aget():
        return await tasks.urgent.aget_result(result.id)

    with pytest.raises(TaskResultMismatch):
        _closing_connections(aget)


def test_a_result_id_is_the_job_s_number():
    """A deliberate difference from the reference backend's UUIDs: the id is the jobs
    table's primary key, as a string in its canonical decimal form."""
    result = tasks.add.enqueue(1, 2)

    assert result.id == str(Job.objects.get(name="django.task.v1").pk)
    run_worker()
    assert tasks.add.get_result(result.id).id == result.id


# The first code point of the digits 0-9 of some scripts whose digits int() reads.
_ZEROS = {"arabic-indic": 0x0660, "devanagari": 0x0966, "fullwidth": 0xFF10}


def _variants(result_id: str) -> st.SearchStrategy[str]:
    """Strings ``int()`` reads as ``result_id``'s number (or nearly), none of them the id."""
    other_digits = st.sampled_from(sorted(_ZEROS.values())).map(
        lambda zero: result_id.translate({ord("0") + n: zero + n for n in range(10)})
    )
    return st.one_of(
        st.sampled_from(
            [
                f"+{result_id}",
                f" {result_id} ",
                f"{result_id}\n",
                f"\t{result_id}",
                f"0{result_id}",
                f"00{result_id}",
                f"{result_id[:1]}_{result_id[1:]}" if len(result_id) > 1 else f"0_{result_id}",
                f"{result_id}.0",
                f"-{result_id}",
                f"{result_id}\x00",
            ]
        ),
        other_digits,
        st.tuples(st.text(" \t\n+0_", min_size=1, max_size=3), st.text(" \t\n", max_size=2)).map(
            lambda around: f"{around[0]}{result_id}{around[1]}"
        ),
    )


def test_only_the_exact_id_of_a_result_finds_it():
    ids = [tasks.add.enqueue(n, n).id for n in range(3)]
    for result_id in ids:
        assert default_task_backend.get_result(result_id).id == result_id

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        candidate=st.one_of(
            st.sampled_from(ids).flatmap(_variants),
            st.text(max_size=24),
            st.integers().map(str),
        )
    )
    def any_other_string_does_not_exist(candidate):
        assume(candidate not in ids)
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(candidate)

    any_other_string_does_not_exist()
