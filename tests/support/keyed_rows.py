"""Job rows made directly in any state, and what becomes of them, for the tests of keys,
look-ups by key and the release of waiting jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, connection, transaction

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob
from tests.support.workflows import settle

UP, DOWN, MINE = "test.noop.v1", "test.after.v1", "test.by_key.mine.v1"

SECOND = 1.0

MINUTE, DAY = 60 * SECOND, 86_400 * SECOND


def backend() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


INSERT_ROW = """
INSERT INTO jobs_job (
    state, attempts, last_error, error_detail, job_id, name, payload, tenant, queue, priority,
    max_attempts, run_after, claimed_by, key_held, replayed_by, keyed, finished_at,
    claim_token, lease_expires_at, waiting_on, depended_on
)
VALUES (
    %(state)s, 1, CASE WHEN %(state)s IN ('failed', 'cancelled') THEN 'handler_error' ELSE '' END,
    '', %(job_id)s, %(name)s, '{}', %(tenant)s, 'default', 0, 5,
    CASE WHEN %(waiting)s = 0 THEN statement_timestamp() END, '', %(held)s, '',
    TRUE, statement_timestamp() - make_interval(secs => %(age)s),
    CASE WHEN %(state)s = 'running' THEN gen_random_uuid() END,
    CASE WHEN %(state)s = 'running' THEN statement_timestamp() + interval '1 hour' END,
    %(waiting)s, %(depended_on)s
)
RETURNING id
"""


def insert(
    cur,
    job_id: str,
    state: str,
    *,
    held: bool,
    age: float | None = None,
    tenant: str = "default",
    name: str = UP,
    waiting: int = 0,
    depended_on: bool = False,
) -> int:
    """A row as the queue would leave it (``age``: seconds since it finished, if it did)."""
    cur.execute(
        INSERT_ROW,
        {
            "state": state,
            "job_id": job_id,
            "name": name,
            "tenant": tenant,
            "held": held,
            "age": age,
            "waiting": waiting,
            "depended_on": depended_on,
        },
    )
    return cur.fetchone()[0]


def table_rows(cur) -> list[tuple]:
    cur.execute(
        "SELECT id, state, key_held, attempts, replayed_by, finished_at IS NULL "
        "FROM jobs_job ORDER BY id"
    )
    return cur.fetchall()


def outcome_of(cur, run: Callable[[], Any]) -> tuple:
    """What ``run`` returns (or that it met the key lock) and the table after, undone."""
    with transaction.atomic():
        try:
            with transaction.atomic():
                result = run()
        except IntegrityError:
            result = "key conflict"
        after = table_rows(cur)
        transaction.set_rollback(True)
    return result, after


def enqueue_one(name: str = UP, **fields) -> int:
    return queue.enqueue(NewJob(name=name, **fields)).id


def end_one(name: str, outcome: str) -> None:
    """Claim one job and end it as ``outcome``, then release what waits for it."""
    [job] = queue.claim([ClaimRequest(name, 1)], scope=AllTenants(), worker="test-worker")
    if outcome == "succeeded":
        assert queue.complete(job)
    else:
        assert queue.fail(job, code="rejected", detail="no")
    settle()


def state_of(pk: int) -> tuple:
    row = Job.objects.get(pk=pk)
    return row.state, row.waiting_on, row.key_held, row.last_error
