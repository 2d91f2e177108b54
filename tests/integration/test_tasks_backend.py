"""Django's task API (@task, .enqueue(), get_result) on the jobs backend, run by the worker."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.tasks import TaskResultStatus, default_task_backend, task_backends
from django.tasks.exceptions import TaskResultDoesNotExist
from django.utils import timezone

from jobs.backends import PostgresBackend
from jobs.models import Job
from jobs.testing import JobFailed, run_worker
from tests.jobapp import tasks

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
