"""A large queued backlog with jobs held by other workers, for plan tests at scale."""

from __future__ import annotations

from django.db import connection

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob

NAME = "test.pass.scale.v1"

BACKLOG = 30_000  # queued: the table's size moves the plan's costs

OTHERS = 300  # jobs other workers hold while this one writes its outcomes


def mine_among_others() -> list:
    """5 jobs this worker holds while another holds ``OTHERS``, with statistics taken when
    nothing was running and plans made afresh from them (a new connection)."""
    queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(BACKLOG)])
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")
    connection.close()
    scope = AllTenants()
    queue.claim([ClaimRequest(NAME, OTHERS)], scope=scope, limit=OTHERS, worker="other")
    return queue.claim([ClaimRequest(NAME, 5)], scope=scope, limit=5, worker="w")
