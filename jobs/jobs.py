"""The jobs app's own job types, discovered at start-up like any app's ``jobs.py``.

``django.task.v1`` runs Django ``@task`` functions; it is registered only when a ``TASKS``
backend is :class:`jobs.backends.PostgresBackend`.
"""

from django.conf import settings

from jobs.catalogue.registry import register

if any(
    config.get("BACKEND") == "jobs.backends.PostgresBackend"
    for config in getattr(settings, "TASKS", {}).values()
):
    from jobs.backends import DjangoTaskV1, run_task, task_policy

    register(DjangoTaskV1, run_task, policy=task_policy())
