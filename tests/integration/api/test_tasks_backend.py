"""Django's task API (@task, .enqueue(), get_result) on the jobs backend, run by the worker."""

from __future__ import annotations

import asyncio
import sys
from datetime import datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.tasks import TaskResult, TaskResultStatus, default_task_backend, task_backends
from django.tasks.exceptions import TaskResultDoesNotExist
from django.test import override_settings
from django.utils import timezone

from jobs.backends import PostgresBackend
from jobs.models import Job
from jobs.testing import JobFailed, run_worker
from tests.jobapp import tasks
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_backend_declares_its_capabilities():
    assert isinstance(task_backends["default"], PostgresBackend)
    assert PostgresBackend.supports_defer
    assert PostgresBackend.supports_get_result
    assert PostgresBackend.supports_priority
    assert PostgresBackend.supports_async_task


def test_enqueue_stores_a_job_and_get_result_reports_it_ready():
    result = tasks.urgent.enqueue()

    assert result.status == TaskResultStatus.READY
    job = Job.objects.get(pk=int(result.id))
    assert (job.name, job.priority, job.queue) == ("django.task.v1", 50, "default")
    assert job.payload["path"] == "tests.jobapp.tasks.urgent"
    assert tasks.urgent.get_result(result.id).status == TaskResultStatus.READY


def test_worker_runs_the_task_and_the_result_is_retrievable():
    result = tasks.add.enqueue(2, b=3)

    run_worker()

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert result.attempts == 1
    assert result.started_at and result.finished_at
    assert (result.args, result.kwargs) == ([2], {"b": 3})


def test_the_result_is_still_retrievable_once_the_job_moved_to_history():
    from jobs.models import JobHistory
    from jobs.queue import history

    result = tasks.add.enqueue(2, b=3)
    run_worker()

    moved = history.archive(now=timezone.now() + timedelta(minutes=1))

    assert moved == {"succeeded": (1, 1)}
    assert JobHistory.objects.filter(pk=int(result.id)).exists()
    again = tasks.add.get_result(result.id)
    assert again.status == TaskResultStatus.SUCCESSFUL
    assert again.return_value == 5
    assert (again.args, again.kwargs) == ([2], {"b": 3})


def test_failures_carry_the_exception_class_and_traceback():
    result = tasks.refuse.enqueue("no such customer")

    with pytest.raises(JobFailed, match="rejected"):
        run_worker()

    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "jobs.errors.Reject"
    assert error.exception_class.__name__ == "Reject"
    assert "no such customer" in error.traceback


def test_retries_apply_to_tasks_like_native_jobs(tmp_path):
    result = tasks.flaky.enqueue(str(tmp_path / "marker"))

    run_worker()

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "second time lucky"
    assert result.attempts == 2
    # Every attempt is kept: the failed first one is listed even though the task succeeded.
    [error] = result.errors
    assert error.exception_class_path == "builtins.ConnectionError"
    assert error.traceback.endswith("ConnectionError: first attempt fails\n")
    assert len(result.worker_ids) == 2 and "unknown" not in result.worker_ids


def test_takes_context_receives_the_task_result():
    result = tasks.introspect.enqueue("ctx")

    run_worker()

    result.refresh()
    assert result.return_value == {"label": "ctx", "attempt": 1, "id": result.id}


def test_async_functions_and_aenqueue():
    async def enqueue():
        try:
            return await tasks.async_double.aenqueue(21)
        finally:
            # aenqueue ran on asgiref's worker thread: close that thread's connection.
            await sync_to_async(connections.close_all)()

    result = asyncio.run(enqueue())

    run_worker()

    assert tasks.async_double.get_result(result.id).return_value == 42


def test_run_after_defers_the_task():
    later = timezone.now() + timedelta(hours=1)
    result = tasks.add.using(run_after=later).enqueue(1, 1)

    run_worker(timeout=1)

    assert tasks.add.get_result(result.id).status == TaskResultStatus.READY
    assert Job.objects.get(pk=int(result.id)).run_after == later


def test_the_payload_keeps_run_after_as_asked_and_leaves_it_out_when_none():
    """The task's own run_after lives in the payload (the row's moves with retries); a
    payload without one is exactly what earlier versions wrote, so their workers run it."""
    later = timezone.now() + timedelta(hours=1)
    plain = tasks.add.enqueue(1, 1)
    deferred = tasks.add.using(run_after=later).enqueue(1, 1)

    assert set(Job.objects.get(pk=int(plain.id)).payload) == {
        "path",
        "args",
        "kwargs",
        "takes_context",
        "backend",
    }
    stored = Job.objects.get(pk=int(deferred.id)).payload["run_after"]
    assert datetime.fromisoformat(stored) == later


def test_unknown_result_id_does_not_exist():
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("not-a-number")


def test_task_finished_signal_reports_the_attempts_outcome():
    from django.tasks.signals import task_finished

    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append((task_result.task.name, task_result.status))

    task_finished.connect(receiver)
    try:
        tasks.add.enqueue(1, 2)
        tasks.refuse.enqueue("nope")
        with pytest.raises(JobFailed):
            run_worker()
    finally:
        task_finished.disconnect(receiver)

    assert ("refuse", TaskResultStatus.FAILED) in seen
    assert all(status != TaskResultStatus.RUNNING for _, status in seen)


# -- what retrying cannot fix fails at once; get_result reads any stored job -------------


def _enqueue_path(
    path: str,
    *args,
    max_attempts: int | None = None,
    queue: str = "default",
    backend: str = "default",
) -> str:
    """A stored django.task.v1 job naming ``path``, as a deploy that removed the task leaves."""
    from jobs.api.producer import enqueue
    from jobs.backends import DjangoTaskV1

    payload = DjangoTaskV1(path=path, args=list(args), kwargs={}, backend=backend)
    return str(enqueue(payload, queue=queue, max_attempts=max_attempts).id)


def _failed_at_once(result_id: str, code: str = "rejected") -> TaskResult:
    """Run the worker; the job must fail on its first attempt with ``code``."""
    with pytest.raises(JobFailed) as failed:
        run_worker(timeout=5)
    assert (failed.value.job_id, failed.value.code) == (
        Job.objects.get(pk=int(result_id)).job_id,
        code,
    )
    job = Job.objects.get(pk=int(result_id))
    assert (job.state, job.last_error, job.attempts, job.result) == ("failed", code, 1, None)
    result = default_task_backend.get_result(result_id)
    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 1
    return result


@pytest.mark.parametrize(
    ("task", "kind", "reason"),
    [
        (tasks.returns_datetime, TypeError, "result: datetime.datetime is not a JSON type"),
        (tasks.returns_object, TypeError, "result: object is not a JSON type"),
        (tasks.returns_nan, ValueError, "result['ratio']: nan is not a JSON number"),
        (tasks.returns_infinity, ValueError, "result[1]: inf is not a JSON number"),
        (
            tasks.returns_nul,
            ValueError,
            "result: a NUL character (\\x00), which PostgreSQL cannot store",
        ),
    ],
    ids=["datetime", "object", "nan", "infinity", "nul"],
)
def test_a_return_value_that_is_not_json_fails_at_once_as_rejected(task, kind, reason):
    result = task.enqueue()

    result = _failed_at_once(result.id)

    [error] = result.errors
    assert error.exception_class is kind
    assert error.traceback.endswith(
        f"\n{kind.__name__}: {task.module_path} returned a value that is not JSON: {reason}\n"
        "a value that is not JSON cannot be stored: the task fails without a retry\n"
    )
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value


def test_return_values_are_normalized_as_django_does():
    result = tasks.returns_normalized.enqueue()

    run_worker()

    result.refresh()
    assert result.return_value == {"pair": [1, 2], "raw": "ok", "nested": [{"n": None}]}


@pytest.mark.parametrize(
    ("path", "cause"),
    [
        ("tests.jobapp.gone.vanished", "ModuleNotFoundError: No module named 'tests.jobapp.gone'"),
        (
            "tests.jobapp.tasks.vanished",
            'ImportError: Module "tests.jobapp.tasks" does not define a "vanished" attribute/class',
        ),
        ("vanished", "ImportError: vanished doesn't look like a module path"),
    ],
    ids=["module", "attribute", "not-a-path"],
)
def test_a_task_that_no_longer_exists_fails_at_once_and_its_result_stays_readable(path, cause):
    result_id = _enqueue_path(path, 1)

    ready = default_task_backend.get_result(result_id)
    assert (ready.status, ready.args, ready.task.name) == (
        TaskResultStatus.READY,
        [1],
        path.rpartition(".")[2],
    )
    # A path without a dot has no module: Task.module_path then starts with the dot.
    assert ready.task.module_path == path if "." in path else f".{path}"

    result = _failed_at_once(result_id)

    [error] = result.errors
    assert error.exception_class_path == "jobs.errors.Reject"
    assert cause in error.traceback
    assert error.traceback.endswith(
        f"jobs.errors.Reject: task {path} cannot be imported: {cause.partition(': ')[2]}\n"
    )
    with pytest.raises(ImportError):
        result.task.call(1)


def test_a_path_that_names_something_other_than_a_task_fails_at_once():
    result_id = _enqueue_path("tests.jobapp.tasks.plain_function")

    assert default_task_backend.get_result(result_id).status == TaskResultStatus.READY
    result = _failed_at_once(result_id)

    [error] = result.errors
    assert error.exception_class_path == "jobs.errors.Reject"
    assert error.traceback.endswith(
        "jobs.errors.Reject: tests.jobapp.tasks.plain_function is a function, "
        "not a django.tasks Task\n"
    )


def test_get_result_does_not_import_the_task_module(tmp_path, monkeypatch):
    (tmp_path / "lazy_tasks.py").write_text(
        "from django.tasks import task\n\n\n@task\ndef hello(name):\n    return 'hi ' + name\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_tasks", raising=False)
    result_id = _enqueue_path("lazy_tasks.hello", "you")

    result = default_task_backend.get_result(result_id)

    assert "lazy_tasks" not in sys.modules
    assert (result.task.name, result.task.module_path) == ("hello", "lazy_tasks.hello")
    # The stand-in imports the task when it is called, and only then.
    assert result.task.call("me") == "hi me"
    assert "lazy_tasks" in sys.modules
    monkeypatch.delitem(sys.modules, "lazy_tasks")


def test_get_result_reads_a_job_whose_queue_the_settings_no_longer_list():
    result_id = _enqueue_path("tests.jobapp.tasks.add", 1, 2, queue="retired")

    result = tasks.add.get_result(result_id)

    assert (result.status, result.task.queue_name) == (TaskResultStatus.READY, "retired")


@pytest.mark.parametrize(
    ("task", "raised"),
    [(tasks.exits, "SystemExit: 3"), (tasks.interrupts, "KeyboardInterrupt")],
    ids=["SystemExit", "KeyboardInterrupt"],
)
def test_a_task_raising_a_base_exception_fails_at_once_and_the_worker_survives(task, raised):
    from django.tasks.signals import task_finished

    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append(task_result.status)

    result = task.enqueue()
    task_finished.connect(receiver)
    try:
        result = _failed_at_once(result.id)
    finally:
        task_finished.disconnect(receiver)

    [error] = result.errors
    kind = raised.partition(":")[0]
    assert error.exception_class_path == f"builtins.{kind}"
    assert error.traceback.endswith(
        f"\n{raised}\n{task.module_path} raised builtins.{kind}, "
        "which is not an Exception: the task fails without a retry\n"
    )
    assert seen == [TaskResultStatus.FAILED]


def test_a_job_naming_a_backend_the_settings_no_longer_have_fails_at_once():
    result_id = _enqueue_path("tests.jobapp.tasks.add", 1, 2, backend="retired")

    result = _failed_at_once(result_id)

    [error] = result.errors
    assert error.exception_class_path == "jobs.errors.Reject"
    assert error.traceback.endswith(
        "jobs.errors.Reject: TASKS has no backend 'retired', the one that enqueued this task\n"
    )


def test_the_result_names_the_backend_that_enqueued_the_task():
    backends = {
        "default": {"BACKEND": "jobs.backends.PostgresBackend"},
        "other": {"BACKEND": "jobs.backends.PostgresBackend"},
    }
    with override_settings(TASKS=backends):
        result = tasks.add.using(backend="other").enqueue(1, 2)

        assert (result.backend, result.task.backend) == ("other", "other")
        result.refresh()
        assert result.status == TaskResultStatus.READY


def test_a_payload_that_does_not_decode_fails_at_once_and_its_result_stays_readable():
    job = JobFactory(
        name="django.task.v1",
        payload={"path": "tests.jobapp.tasks.add", "args": [1, 2], "kwargs": {}, "later": 1},
    )

    ready = default_task_backend.get_result(str(job.pk))
    assert (ready.status, ready.task.name, ready.args) == (TaskResultStatus.READY, "add", [1, 2])

    result = _failed_at_once(str(job.pk), code="invalid_payload")

    [error] = result.errors
    assert error.exception_class_path == "jobs.catalogue.payloads.InvalidPayload"
    assert error.traceback == "invalid_payload: unknown field 'later'"


# -- get_result's errors: the exception class and traceback of the last failure ----------


def test_the_exception_class_is_read_past_multiline_messages_and_notes():
    result = tasks.raises_multiline.enqueue()

    result = _failed_at_once(result.id)

    [error] = result.errors
    assert error.exception_class_path == "tests.jobapp.tasks.TaskProblem"
    assert error.exception_class is tasks.TaskProblem
    assert "SecondLine: not an exception class\na note" in error.traceback


def test_the_exception_class_is_read_past_a_traceback_quoted_in_the_message():
    result = tasks.raises_quoting_a_traceback.enqueue()

    result = _failed_at_once(result.id)

    [error] = result.errors
    assert error.exception_class_path == "tests.jobapp.tasks.TaskProblem"
    assert error.traceback.endswith("OtherError: remote\n")


def test_a_chained_exception_reports_the_last_one_raised():
    result = tasks.raises_chained.enqueue()

    result = _failed_at_once(result.id)

    [error] = result.errors
    assert error.exception_class_path == "tests.jobapp.tasks.TaskProblem"
    assert "KeyError: 'missing'" in error.traceback


def test_an_exception_group_reports_its_own_class():
    result_id = _enqueue_path("tests.jobapp.tasks.raises_group", max_attempts=1)

    result = _failed_at_once(result_id, code="handler_error")

    [error] = result.errors
    assert error.exception_class_path == "builtins.ExceptionGroup"
    assert "ValueError: one" in error.traceback


@pytest.mark.parametrize(
    ("code", "detail", "class_path"),
    [
        (
            "deadline_exceeded",
            "handler ran 301.000s, over its 300s limit",
            "builtins.TimeoutError",
        ),
        ("cancelled", "cancelled by alice", "jobs.errors.Cancelled"),
        ("lease_expired", "lease expired while held by vm:1", "builtins.Exception"),
        ("stale", "", "builtins.Exception"),
    ],
)
def test_a_failure_without_a_traceback_reports_its_code(code, detail, class_path):
    job = JobFactory(
        name="django.task.v1",
        payload={"path": "tests.jobapp.tasks.add", "args": [1, 2], "kwargs": {}},
        failed=True,
        last_error=code,
        error_detail=detail,
    )

    [error] = default_task_backend.get_result(str(job.pk)).errors

    assert error.exception_class_path == class_path
    assert error.traceback == (f"{code}: {detail}" if detail else code)


def test_a_traceback_cut_short_reports_exception():
    detail = 'Traceback (most recent call last):\n  File "tasks.py", line 3, in f\n    g()'
    job = JobFactory(
        name="django.task.v1",
        payload={"path": "tests.jobapp.tasks.add", "args": [1, 2], "kwargs": {}},
        failed=True,
        error_detail=detail,
    )

    [error] = default_task_backend.get_result(str(job.pk)).errors

    assert (error.exception_class_path, error.traceback) == ("builtins.Exception", detail)


def test_a_retry_that_waits_reports_the_error_of_the_attempt_before():
    detail = (
        'Traceback (most recent call last):\n  File "t.py", line 1, in f\nConnectionError: down'
    )
    job = JobFactory(
        name="django.task.v1",
        payload={"path": "tests.jobapp.tasks.add", "args": [1, 2], "kwargs": {}},
        attempts=1,
        last_error="handler_error",
        error_detail=detail,
    )

    result = default_task_backend.get_result(str(job.pk))

    assert result.status == TaskResultStatus.READY
    assert [(e.exception_class_path, e.traceback) for e in result.errors] == [
        ("builtins.ConnectionError", detail)
    ]


# -- arguments: refused at enqueue unless the jobs table can store them as JSON ---------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ([timezone.now()], {}, TypeError, "args[0]: datetime.datetime is not a JSON type"),
        ([], {"ratio": float("nan")}, ValueError, "kwargs['ratio']: nan is not a JSON number"),
        ([{"a": [float("-inf")]}], {}, ValueError, "args[0]['a'][0]: -inf is not a JSON number"),
        (["a\x00b"], {}, ValueError, "args[0]: a NUL character (\\x00), which PostgreSQL"),
        (["\ud800"], {}, ValueError, "args[0]: a lone surrogate, which is not valid UTF-8"),
        ([b"\xff"], {}, ValueError, "args[0]: bytes that are not UTF-8"),
        ([{(1, 2): "pair"}], {}, TypeError, "args[0]: a key of type tuple (JSON keys are strings)"),
    ],
    ids=["datetime", "nan", "nested-infinity", "nul", "surrogate", "bytes", "tuple-key"],
)
def test_arguments_that_are_not_json_are_refused_at_enqueue(args, kwargs, error, message):
    with transaction.atomic():
        with pytest.raises(error) as refused:
            tasks.echo.enqueue(*args, **kwargs)
        # Refused before any statement ran: the caller's transaction is still usable.
        assert not Job.objects.filter(name="django.task.v1").exists()

    assert str(refused.value) == message or str(refused.value).startswith(message)


def test_a_list_that_contains_itself_is_refused_at_enqueue():
    loop: list = []
    loop.append(loop)

    with pytest.raises(ValueError, match=r"^args\[0\]\[0\]: a container that contains itself$"):
        tasks.echo.enqueue(loop)


def test_arguments_round_trip_as_json_does_with_non_string_keys():
    result = tasks.echo.enqueue({1: "one", 2.5: "half", None: "none", b"raw": [b"ok", (1,)]})

    expected = {"1": "one", "2.5": "half", "null": "none", "raw": ["ok", [1]]}
    assert result.args == [expected]
    run_worker()
    result.refresh()
    assert result.return_value == expected


def test_get_result_lists_the_error_and_the_worker_of_every_attempt():
    from jobs import queue
    from jobs.queue import ClaimRequest
    from jobs.queue.types import AllTenants

    result = tasks.add.enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(max_attempts=3)
    for attempt, worker in enumerate(("host-a:1", "host-b:2", "host-a:3"), start=1):
        Job.objects.filter(pk=result.id).update(run_after=timezone.now() - timedelta(seconds=1))
        [job] = queue.claim([ClaimRequest("django.task.v1", 1)], scope=AllTenants(), worker=worker)
        detail = (
            'Traceback (most recent call last):\n  File "x.py", line 1, in add\n'
            f"ValueError: attempt {attempt}"
        )
        if attempt < 3:
            queue.retry(job, code="handler_error", detail=detail)
        else:
            queue.fail(job, code="handler_error", detail=detail)

    result.refresh()

    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"] * 3
    assert [e.traceback.rsplit(": ", 1)[-1] for e in result.errors] == [
        "attempt 1",
        "attempt 2",
        "attempt 3",
    ]
    assert result.worker_ids == ["host-a:1", "host-b:2", "host-a:3"]
