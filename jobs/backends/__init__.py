"""A ``django.tasks`` backend that stores tasks in the jobs table.

    TASKS = {"default": {"BACKEND": "jobs.backends.PostgresBackend"}}

Functions decorated with Django's ``@task`` are enqueued as jobs of one built-in type,
``django.task.v1``, whose payload names the task function and carries its arguments. They run
under ``manage.py runworker`` like any other job type: leases, retries with backoff, drain,
metrics, and the admin's failure monitor and replay. ``get_result()`` reads the job row and
never imports the task, so results stay readable after a task is removed.

A task's own exceptions retry like any handler's (``Reject`` ends at once); what retrying
cannot fix fails at once as ``rejected``: a task that cannot be imported or is not a
``Task``, a return value that is not JSON, a ``BaseException`` that is not an ``Exception``,
a backend alias no longer configured. Arguments that are not JSON are refused at enqueue.
docs/tasks.md has the table of every case and what ``get_result()`` then reports.

OPTIONS (all optional): ``DATABASE`` (alias, default ``JOBS["DATABASE"]``), ``MAX_ATTEMPTS``
(default ``JOBS["DEFAULT_MAX_ATTEMPTS"]``), ``CONCURRENCY`` (tasks run at once per worker,
default: as many as the worker's ``--concurrency``) and ``TIMEOUT`` (seconds, default 300).
"""

from jobs.backends.postgres import (
    BACKEND_PATH,
    JobTaskContext,
    JobTaskResult,
    PostgresBackend,
    check_task_backend,
    run_task,
    task_policy,
)
from jobs.backends.stored import DjangoTaskV1

__all__ = [
    "BACKEND_PATH",
    "DjangoTaskV1",
    "JobTaskContext",
    "JobTaskResult",
    "PostgresBackend",
    "check_task_backend",
    "run_task",
    "task_policy",
]
