"""The claim path is an index scan on the claim index, even beside many finished rows."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.queue import AllTenants, AllTenantsExcept, OnlyTenant, claim_sql

pytestmark = pytest.mark.django_db

FILL = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at, finished_at)
SELECT 'fill-' || %(state)s || '-' || g, 'test.noop.v1', '{}', 'default', 'default', 0, 5,
       now() - interval '1 minute', %(state)s, 1, '', '', '', %(state)s = 'queued', '', now(),
       CASE WHEN %(state)s = 'queued' THEN NULL ELSE now() END
FROM generate_series(1, %(count)s) AS g
"""


def explain(scope) -> str:
    sql, scope_params = claim_sql(scope)
    params = {
        "names": ["test.noop.v1"],
        "limits": [10],
        "caps": [None],
        "total": 10,
        "lease": 10.0,
        "worker": "plan",
        **scope_params,
    }
    with connection.cursor() as cur:
        cur.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cur.fetchall())


@pytest.mark.parametrize(
    "scope", [AllTenants(), AllTenantsExcept("worker"), OnlyTenant("default")], ids=repr
)
def test_claim_uses_the_claim_index(scope):
    with connection.cursor() as cur:
        cur.execute(FILL, {"state": "succeeded", "count": 20000})
        cur.execute(FILL, {"state": "queued", "count": 2000})
        cur.execute("ANALYZE jobs_job")

    plan = explain(scope)

    assert "jobs_job_claim" in plan, plan
    assert "Seq Scan on jobs_job" not in plan, plan
