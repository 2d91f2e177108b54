"""The worker's exhaustion pass reads only rows that can be exhausted, never the fresh backlog.

A queued job can run out of attempts only once it has run (a retry) or when its own limit is
below its attempts; the pass finds those through small partial indexes, so its cost does not
grow with the number of fresh queued jobs (attempts = 0).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, AllTenantsExcept, OnlyTenant
from jobs.queue.maintenance import fail_exhausted_sql
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db

FRESH = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT 'fresh-' || g, 'test.noop.v1', '{}', 'default', 'default', 0, 5, now(), 'queued', 0,
       '', '', '', TRUE, '', now()
FROM generate_series(1, %(count)s) AS g
"""


def explain(scope, caps: dict[str, int]) -> str:
    sql, params = fail_exhausted_sql(scope=scope, max_attempts=caps, limit=100)
    with connection.cursor() as cur:
        cur.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cur.fetchall())


@pytest.mark.parametrize(
    "scope", [AllTenants(), AllTenantsExcept("worker"), OnlyTenant("default")], ids=repr
)
def test_the_exhaustion_pass_never_reads_the_fresh_backlog(scope):
    with connection.cursor() as cur:
        cur.execute(FRESH, {"count": 20000})
        cur.execute("ANALYZE jobs_job")

    plan = explain(scope, {"test.noop.v1": 3, "other.v1": 2})

    assert "Seq Scan on jobs_job" not in plan, plan
    assert "jobs_job_retrying" in plan, plan
    assert "jobs_job_out_of_attempts" in plan, plan
    assert "jobs_job_claim" not in plan, plan  # the claim index holds the whole backlog


def test_the_pass_still_fails_what_it_should_and_nothing_else():
    """Lowered limits, a job over its own limit, a lease lost on the last attempt."""
    now = timezone.now()
    lowered = JobFactory(name="test.noop.v1", attempts=3, max_attempts=10)
    below = JobFactory(name="test.noop.v1", attempts=2, max_attempts=10)
    over_own = JobFactory(name="other.v1", attempts=5, max_attempts=5)
    fresh = JobFactory(name="test.noop.v1", attempts=0, max_attempts=10)
    lost = JobFactory(
        name="other.v1",
        running=True,
        attempts=3,
        max_attempts=3,
        lease_expires_at=now - timedelta(seconds=1),
    )

    failed = queue.fail_exhausted(max_attempts={"test.noop.v1": 3})

    assert sorted(row.id for row in failed) == sorted([lowered.id, over_own.id, lost.id])
    codes = {row.id: row.code for row in failed}
    assert codes[lost.id] == "lease_expired"
    assert codes[lowered.id] == codes[over_own.id] == "attempts_exhausted"
    untouched = dict(Job.objects.filter(pk__in=[below.id, fresh.id]).values_list("pk", "state"))
    assert untouched == {below.id: "queued", fresh.id: "queued"}
