"""Jobs run to an end and found again in the jobs table or the history table."""

from __future__ import annotations

from datetime import timedelta

from jobs import queue
from jobs.models import Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob

NAME = "test.history.v1"


def finish(*jobs: NewJob, state: str = "succeeded", result=None) -> list[int]:
    """Enqueue and run these jobs to ``state``; their ids."""
    ids = [e.id for e in queue.enqueue_many(list(jobs))]
    claimed = queue.claim([ClaimRequest(NAME, len(ids))], scope=AllTenants(), worker="test-worker")
    assert sorted(c.id for c in claimed) == sorted(ids)
    for job in claimed:
        if state == "succeeded":
            assert queue.complete(job, result)
        else:
            assert queue.fail(job, code="handler_error", detail="boom")
    return ids


def job(job_id: str | None = None, **fields) -> NewJob:
    return NewJob(name=NAME, payload={"n": 1}, job_id=job_id, **fields)


def where(pk: int) -> str:
    if Job.objects.filter(pk=pk).exists():
        return "jobs"
    if JobHistory.objects.filter(pk=pk).exists():
        return "history"
    return "gone"


MINUTE = timedelta(minutes=1)


def ready_history(ahead: timedelta = timedelta(hours=2)) -> None:
    """Attach the history's partitions from now to ``ahead`` for every end, and say so in
    ``jobs_historyready``, as the scheduler keeps them: jobs that end then leave the jobs
    table in the statement that ends them."""
    from django.db import connection

    from jobs.db.clock import database_now
    from jobs.queue import history
    from jobs.runs import TERMINAL_STATES

    now = database_now()
    with connection.cursor() as cur:
        for state in TERMINAL_STATES:
            history.ensure(cur, state, now, now + ahead)
            cur.execute(
                "INSERT INTO jobs_historyready (state, until) VALUES (%s, %s) "
                "ON CONFLICT (state) DO UPDATE SET until = EXCLUDED.until",
                [state, now + ahead],
            )
