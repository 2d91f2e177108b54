"""Helpers for your own end-to-end tests: run the real worker, in-process, until done.

    from jobs.testing import run_worker

    @pytest.mark.django_db(transaction=True)
    def test_signup_sends_the_welcome_email(client):
        client.post("/signup/", {...})          # commits the user and its jobs
        run_worker()                            # claims and runs them through the real worker
        assert mail.outbox[0].subject == "Welcome"

There is deliberately no "call the handler directly" shortcut: the point is to exercise the
publication, claim, decoding and dispatch path your production code relies on. The worker
needs committed data, so use ``transaction=True`` tests (or ``TransactionTestCase``).
"""

from __future__ import annotations

import time
from datetime import timedelta

from jobs import queue
from jobs.catalogue import routing as databases
from jobs.catalogue.registry import Registry, get_registry
from jobs.queue import OnlyTenant, Scope
from jobs.worker.config import WorkerConfig, scope_from
from jobs.worker.runner import Worker


class JobFailed(AssertionError):
    """A job became failed while :func:`run_worker` ran."""

    def __init__(self, name: str, job_id: str, code: str, detail: str) -> None:
        self.name, self.job_id, self.code, self.detail = name, job_id, code, detail
        super().__init__(f"job {job_id} ({name}) failed: {code}\n{detail}")


class WorkerTimeout(AssertionError):
    """Eligible jobs were still pending when :func:`run_worker`'s deadline passed."""


def run_worker(
    *,
    timeout: float = 10.0,
    tenant: str | None = None,
    registry: Registry | None = None,
    concurrency: int = 4,
    database: str | None = None,
) -> None:
    """Run a real worker until every eligible job is done, failing fast on a terminal failure.

    Eligible jobs are queued jobs of registered types in the worker's scope (all tenants
    without an override, or just ``tenant``) that are due before the deadline, including
    retries waiting out a short backoff. Raises :class:`JobFailed` as soon as one becomes
    failed and :class:`WorkerTimeout` if work remains after ``timeout`` seconds. ``database``
    is the alias to run the jobs of, as ``runworker --database`` (default ``JOBS["DATABASE"]``).
    """
    registry = registry or get_registry()
    database = database or databases.home()
    scope = OnlyTenant(tenant) if tenant else scope_from(None, None)
    failures: list[JobFailed] = []
    deadline = time.monotonic() + timeout
    worker: Worker

    def failed(name: str, job_id: str, code: str, detail: str) -> None:
        failures.append(JobFailed(name, job_id, code, detail))
        worker.request_stop(force=True)

    def done(w: Worker) -> bool:
        if failures:
            return True
        if time.monotonic() >= deadline:
            return True
        return w.idle and not _pending(registry, scope, deadline, database)

    config = WorkerConfig(
        scope=scope,
        concurrency=concurrency,
        poll_interval=0.05,
        maintenance_interval=0.5,
        shutdown_timeout=1.0,
        install_signal_handlers=False,
        database=database,
    )
    worker = Worker(registry, config, on_terminal_failure=failed)
    worker.run(until=done)
    if failures:
        raise failures[0]
    left = _pending(registry, scope, deadline, database)
    if left:
        raise WorkerTimeout(f"jobs still pending after {timeout:g}s: {left}")


def _pending(registry: Registry, scope: Scope, deadline: float, database: str) -> dict[str, int]:
    """Eligible work left: queued jobs due before the deadline, and running jobs."""
    horizon = timedelta(seconds=max(0.0, deadline - time.monotonic()))
    names = databases.served(registry, database)
    return queue.pending(scope=scope, names=names, due_within=horizon, using=database)
