"""Time the claim with no pauses, with 100 pause rows, and with a paused tenant in the way.

    .venv/bin/python bench/pause_claim.py [--queued 100000] [--rounds 300]

Fills a scratch database (``<db>_pause_bench``) with queued jobs of four types and twenty
tenants, then times the claim of 10 jobs (a transaction rolled back each time, so every round
sees the same rows) in three set-ups, alternating rounds so a noisy machine affects all alike:

* ``none``: an empty pauses table (the baseline);
* ``100 unrelated``: 100 pause rows (job types, queues and tenants) naming nothing queued,
  the common case of a table that holds some pauses;
* ``tenant in the way``: one paused tenant holding a twentieth of the backlog, interleaved
  with the rows that may run;
* ``flood ahead``: the worst case, a paused tenant whose 20,000 jobs of another type are all
  older than that type's 100 runnable ones: the claim reads past every paused row first
  (the index orders by type, priority and due time; tenants are not in it).

Prints the median and p95 claim time of each and the ratio to ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _setup import setup

FILL = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT 'pause-' || g, 'bench.type' || (g %% 4) || '.v1', '{"n": 1}', 'tenant-' || (g %% 20),
       'default', 0, 5, now() - make_interval(secs => g), 'queued', 0, '', '', '', TRUE, '',
       now()
FROM generate_series(1, %(count)s) AS g
"""

FLOOD = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at)
SELECT 'flood-' || g, 'bench.flooded.v1', '{}', CASE WHEN g <= 20000 THEN 'flood' ELSE 'other' END,
       'default', 0, 5, now() - make_interval(secs => 100000 - g), 'queued', 0, '', '', '', TRUE,
       '', now()
FROM generate_series(1, 20100) AS g
"""

PAUSE_TENANT = (
    "INSERT INTO jobs_pause (kind, value, reason, paused_by) VALUES ('tenant', '{tenant}', '', '')"
)

UNRELATED = """
INSERT INTO jobs_pause (kind, value, reason, paused_by)
SELECT (ARRAY['job_type', 'queue', 'tenant'])[1 + g % 3], 'nothing-' || g, 'bench', 'bench'
FROM generate_series(1, 100) AS g
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    setup("_pause_bench")
    from django.db import connection, transaction

    from jobs.queue import AllTenants, ClaimRequest, claim

    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job, jobs_pause")
        cur.execute(FILL, {"count": args.queued})
        cur.execute(FLOOD)
        cur.execute("VACUUM ANALYZE jobs_job")

    setups = {
        "none": [],
        "100 unrelated": [UNRELATED],
        "tenant in the way": [PAUSE_TENANT.format(tenant="tenant-0")],
        "flood ahead": [PAUSE_TENANT.format(tenant="flood")],
    }
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, statements in setups.items():
            job_type = "bench.flooded.v1" if name == "flood ahead" else "bench.type0.v1"
            request = [ClaimRequest(job_type, 10)]
            with transaction.atomic():
                with connection.cursor() as cur:
                    for statement in statements:
                        cur.execute(statement)
                started = time.perf_counter()
                claimed = claim(request, scope=AllTenants(), worker="bench")
                times[name].append(time.perf_counter() - started)
                transaction.set_rollback(True)
            if len(claimed) != 10:
                raise SystemExit(f"{name}: claimed {len(claimed)} jobs, not 10")

    base = statistics.median(times["none"])
    print(f"claim of 10 from {args.queued:,} queued jobs, {args.rounds} rounds each")
    print(f"{'pauses':<20}{'median ms':>11}{'p95 ms':>9}{'ratio':>8}")
    for name, samples in times.items():
        samples.sort()
        median = statistics.median(samples)
        p95 = samples[int(len(samples) * 0.95) - 1]
        print(f"{name:<20}{median * 1000:>11.3f}{p95 * 1000:>9.3f}{median / base:>7.2f}x")


if __name__ == "__main__":
    main()
