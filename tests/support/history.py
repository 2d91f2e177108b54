"""Jobs run to an end and found again in the jobs table or the history table, and rows written
straight into the history as the worker's pass writes them."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import datetime, timedelta

from django.db import connection

from jobs import queue
from jobs.models import Job, JobHistory
from jobs.queue import AllTenants, ClaimRequest, NewJob, history
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


def insert_row(cur, state: str, at: datetime, pk: int = 1) -> None:
    """Write one finished row of ``state`` straight into the history, finished at ``at``."""
    cur.execute(_ROW.format(at="%(at)s"), {"id": pk, "state": state, "at": at})


def _when_ready(sql: str) -> str:
    """``sql`` writing only where the history is ready for the row, as the pass must."""
    ready = f"WHERE statement_timestamp() < {history.READY_UNTIL}".format(state="%(state)s")
    return sql.format(at="statement_timestamp()") + ready


def insert_if_ready(cur, state: str, pk: int = 1) -> int:
    """Write a row of ``state`` finished now where the history is ready for it; rows written."""
    cur.execute(_when_ready(_ROW), {"id": pk, "state": state})
    return cur.rowcount


def ready_until(state: str) -> datetime | None:
    """The time up to which the history is ready for rows of ``state``, as the pass reads it."""
    with connection.cursor() as cur:
        cur.execute(f"SELECT {history.READY_UNTIL.format(state='%s')}", [state])
        return cur.fetchone()[0]


class HistoryWriter:
    """A connection of its own writing history rows in a loop, one transaction each.

    It writes as the worker's pass does once it ends jobs straight into the history: a row
    finished now, of each state in turn. With ``ready_only`` the statement reads
    ``history.READY_UNTIL`` and writes only where the history says it is ready, as the pass
    must; without it, it writes regardless (into partitions the test made). Each statement
    is timed, and every error is kept for the test to see.
    """

    def __init__(self, states: tuple[str, ...], *, ready_only: bool = False) -> None:
        self.sql = _when_ready(_ROW) if ready_only else _ROW.format(at="statement_timestamp()")
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


def ready_history() -> None:
    """Make the history ready ahead, as the scheduler's archive duty keeps it: jobs that end
    then leave the jobs table in the statement that ends them."""
    from jobs.queue import history

    history.prepare_ahead()
    assert ready_until("succeeded") is not None
