"""Show the claim statement's plan on a table of 100,000 queued and 1,000,000 finished jobs.

    .venv/bin/python bench/claim_plan.py [--queued 100000] [--finished 1000000]

Fills a scratch database (``<db>_bench``), runs EXPLAIN (ANALYZE, BUFFERS) on the claim of
10 jobs inside a transaction that is rolled back, and prints the plan. The claim must be an
index scan on ``jobs_job_claim``, never a sequential scan of the table.
"""

from __future__ import annotations

import argparse
import time

from _setup import setup

FILL = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at, finished_at)
SELECT 'plan-' || %(state)s || '-' || g,
       'bench.type' || (g %% 4) || '.v1',
       '{"n": 1}', 'tenant-' || (g %% 20), 'default', (g %% 3) - 1, 5,
       now() - make_interval(secs => g %% 3600), %(state)s, 1, '', '', '',
       %(state)s = 'queued', '', now(),
       CASE WHEN %(state)s = 'queued' THEN NULL ELSE now() - make_interval(secs => g %% 86400) END
FROM generate_series(1, %(count)s) AS g
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--finished", type=int, default=1_000_000)
    args = parser.parse_args()
    setup()
    from django.db import connection, transaction

    from jobs.queue import AllTenantsExcept, claim_sql

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job")
        started = time.monotonic()
        cur.execute(FILL, {"state": "succeeded", "count": args.finished})
        cur.execute(FILL, {"state": "queued", "count": args.queued})
        print(
            f"filled {args.queued:,} queued + {args.finished:,} finished rows "
            f"in {time.monotonic() - started:.1f}s"
        )
        cur.execute("VACUUM ANALYZE jobs_job")
    sql, scope_params = claim_sql(AllTenantsExcept("worker"))
    params = {
        "names": ["bench.type1.v1"],
        "limits": [10],
        "caps": [None],
        "total": 10,
        "lease": 10.0,
        "worker": "plan",
        **scope_params,
    }
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql, params)
        plan = "\n".join(row[0] for row in cur.fetchall())
        transaction.set_rollback(True)
    print(plan)
    if "Seq Scan on jobs_job" in plan:
        raise SystemExit("the claim plan scans the whole jobs table")


if __name__ == "__main__":
    main()
