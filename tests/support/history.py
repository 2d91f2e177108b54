"""Jobs run to an end and found again in the jobs table or the history table, and rows written
straight into the history as the worker's pass will write them."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta

from django.db import connection

from jobs import queue
from jobs.models import Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob
from tests.support.polling import wait_for

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


# One history row as the worker's pass writes it: only the columns without a default.
_ROW = f"""
INSERT INTO jobs_jobhistory (
    id, state, attempts, last_error, error_detail, created_at, finished_at, job_id, name,
    payload, tenant, queue, priority, max_attempts, claimed_by, keyed, replayed_by
)
SELECT %(id)s, %(state)s, 1, '', '', {{at}}, {{at}}, 'history-row', '{NAME}', '{{{{}}}}',
       'default', 'default', 0, 1, '', TRUE, ''
"""


class HistoryWriter:
    """A connection of its own writing history rows in a loop, one transaction each.

    It writes as the worker's pass will once it ends jobs straight into the history: a row
    finished now, of each state in turn, into partitions the test made. Each statement is
    timed, and every error is kept for the test to see.
    """

    def __init__(self, states: tuple[str, ...]) -> None:
        self.sql = _ROW.format(at="statement_timestamp()")
        self.states = states
        self.statements = self.written = 0
        self.longest = 0.0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HistoryWriter:
        self._thread.start()
        self.wait_for_statements(3)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the history writer did not stop"

    def wait_for_statements(self, more: int) -> None:
        """Return once ``more`` statements have ended after this call (or it failed)."""
        target = self.statements + more
        wait_for(lambda: self.statements >= target or self.errors, what=f"{more} inserts")

    def _run(self) -> None:
        try:
            with connection.cursor() as cur:
                for pk in itertools.count(10_000_000):
                    if self._stop.is_set():
                        return
                    state = self.states[pk % len(self.states)]
                    started = time.monotonic()
                    try:
                        cur.execute(self.sql, {"id": pk, "state": state})
                    except Exception as exc:  # kept for the test: it must never happen
                        self.errors.append(exc)
                        return
                    self.longest = max(self.longest, time.monotonic() - started)
                    self.written += cur.rowcount
                    self.statements += 1
        finally:
            connection.close()
