"""Several databases, attacked: what a worker, the scheduler, the admin and the checks do on an
alias that is not the home one, and when one of the aliases is gone.

Each test here failed before the fix it came with (see the commit that added it). The ``other``
alias and the types bound to it are those of tests/integration/test_databases.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from django.db import connections

import jobs
from jobs import JobContext, Payload
from jobs.errors import RetryAfter
from jobs.models import Job
from jobs.registry import JobType, Policy, Registry, catalogue, get_registry
from jobs.testing import run_worker
from tests.dbapp.types import OTHER, job_types
from tests.runapp.models import QuickRun

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", OTHER])

BOTH = ["default", OTHER]


class RunThereV1(Payload, name="review.run_there.v1"):
    """A job of the other database that drives a run row there, retried once in process."""

    run_id: int


def run_there(payload: RunThereV1, ctx: JobContext) -> dict[str, object]:
    if ctx.attempt == 1:
        raise RetryAfter(0.01, "once more, in this process")
    return {"attempt": ctx.attempt, "using": ctx.using}


REVIEW_TYPES = [
    JobType(RunThereV1, run_there, Policy(database=OTHER, run_model=QuickRun, max_attempts=3)),
]


@pytest.fixture
def registry(monkeypatch, settings) -> Registry:
    """The dbapp types and this module's, registered; both aliases configured for jobs."""
    registry = Registry([*get_registry(), *job_types(), *REVIEW_TYPES])
    monkeypatch.setattr(catalogue, "_registry", registry)
    settings.JOBS = {**settings.JOBS, "DATABASES": BOTH}
    return registry


@contextlib.contextmanager
def unreachable(alias: str) -> Iterator[None]:
    """New connections to ``alias`` fail, from any thread (as when its server is down).

    Connections already open (the test's own) stay open, so the test can look afterwards.
    """
    settings_dict = connections.settings[alias]
    host = settings_dict["HOST"]
    settings_dict["HOST"] = "/nonexistent/jobs-review-socket-dir"
    try:
        yield
    finally:
        settings_dict["HOST"] = host


# A worker on another alias needs nothing of the home one ---------------------------------------


def test_a_worker_on_the_other_database_runs_its_run_row_jobs_with_default_down(registry):
    """The worker's own writes on a handler thread (the run row's start, the next attempt of an
    in-process retry) went through a bounded transaction on ``default``: with that server down,
    every run-row job of the other database failed, though nothing of it lives on default."""
    row = QuickRun.objects.using(OTHER).create(job_id="run-there", state="queued")
    done = jobs.enqueue(RunThereV1(run_id=row.pk))

    with unreachable("default"):
        run_worker(registry=registry, database=OTHER)

    job = Job.objects.using(OTHER).get(pk=done.id)
    assert (job.state, job.attempts, job.result) == ("succeeded", 2, {"attempt": 2, "using": OTHER})
    ran = QuickRun.objects.using(OTHER).get(pk=row.pk)
    assert (ran.state, ran.attempts) == ("succeeded", 2)
