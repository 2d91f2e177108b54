"""Time the claim with each flow control enabled, against the same claim without controls.

    .venv/bin/python bench/flow_claim.py [--queued 100000] [--rounds 300] [--claim 10]

Fills a scratch database (``<db>_flow_bench``) with queued jobs of one type spread over
tenants (all in the per-tenant claim index as well, so every set-up reads the same rows),
then times one claim (a transaction rolled back each time, so every round sees the same
rows) in each set-up, alternating rounds so a noisy machine affects all alike:

* ``none``: no controls, the plain claim statement (the baseline);
* ``global limit``: ``global_concurrency`` (the gate, and a count of running jobs);
* ``rate limit``: ``rate_limit`` (the gate and its bucket);
* ``fair, 2 tenants`` / ``fair, 20 tenants`` / ``fair, 1,000 tenants``: ``fair=True`` with
  the backlog spread over that many tenants, each with an account in play (as a type that
  has been claimed a while has; one claim reads up to ``--claim`` of them least served
  first, and as many of the worker's rotation);
* ``tenant limit, 20 tenants``: ``tenant_concurrency`` with 50 jobs already running;
* ``everything, 20 tenants``: a global limit, a rate, a tenant limit and a tenant rate.

Prints the median and p95 claim time of each and the ratio to ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _setup import setup

NAME = "bench.flow.v1"

FILL = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at, fair)
SELECT 'flow-{tenants}-' || g, %(name)s, '{{"n": 1}}', 't{tenants}-' || (g %% {tenants}),
       'default', 0, 5, now() - make_interval(secs => g), 'queued', 0, '', '', '', TRUE, '',
       now(), TRUE
FROM generate_series(1, %(count)s) AS g
"""

# Each tenant's account in play, the least served ones spread at random.
ACCOUNTS = """
INSERT INTO jobs_fairaccount (name, tenant, served, starts)
SELECT %(name)s, 't{tenants}-' || g, random(), 0 FROM generate_series(0, {tenants} - 1) AS g
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--claim", type=int, default=10)
    args = parser.parse_args()
    setup("_flow_bench")
    from django.db import connection, transaction

    from jobs.queue import AllTenants, ClaimRequest, claim, flow
    from jobs.queue.flow import FlowLimits

    spreads = {2: f"{NAME}", 20: f"{NAME}.20", 1000: f"{NAME}.1000"}
    with connection.cursor() as cur:
        cur.execute("TRUNCATE jobs_job, jobs_pause, jobs_flow, jobs_flowtenant, jobs_fairaccount")
        for tenants, name in spreads.items():
            cur.execute(FILL.format(tenants=tenants), {"name": name, "count": args.queued})
            cur.execute(ACCOUNTS.format(tenants=tenants), {"name": name})
        cur.execute("VACUUM ANALYZE jobs_job")
    # 50 running jobs of the 20-tenant type, for the limits to count.
    claim([ClaimRequest(spreads[20], 50)], scope=AllTenants(), worker="others")

    setups: dict[str, tuple[str, FlowLimits | None]] = {
        "none": (spreads[20], None),
        "global limit": (spreads[20], FlowLimits(global_concurrency=10_000)),
        "rate limit": (spreads[20], FlowLimits(rate=1e6, burst=1e6)),
        "fair, 2 tenants": (spreads[2], FlowLimits(fair=True)),
        "fair, 20 tenants": (spreads[20], FlowLimits(fair=True)),
        "fair, 1,000 tenants": (spreads[1000], FlowLimits(fair=True)),
        "tenant limit, 20 tenants": (spreads[20], FlowLimits(tenant_concurrency=100)),
        "everything, 20 tenants": (
            spreads[20],
            FlowLimits(
                global_concurrency=10_000,
                tenant_concurrency=100,
                rate=1e6,
                burst=1e6,
                tenant_rate=1e6,
                tenant_burst=1e6,
            ),
        ),
    }
    for name, limits in setups.values():
        if limits is not None:
            flow.ensure({name: limits})
    times: dict[str, list[float]] = {label: [] for label in setups}
    for _ in range(args.rounds):
        for label, (name, limits) in setups.items():
            request = [ClaimRequest(name, args.claim)]
            with transaction.atomic():
                started = time.perf_counter()
                claimed = claim(
                    request,
                    scope=AllTenants(),
                    worker="bench",
                    limits=None if limits is None else {name: limits},
                )
                times[label].append(time.perf_counter() - started)
                transaction.set_rollback(True)
            if len(claimed) != args.claim:
                raise SystemExit(f"{label}: claimed {len(claimed)} jobs, not {args.claim}")

    base = statistics.median(times["none"])
    print(f"claim of {args.claim} from {args.queued:,} queued jobs, {args.rounds} rounds each")
    print(f"{'controls':<26}{'median ms':>11}{'p95 ms':>9}{'ratio':>8}")
    for label, samples in times.items():
        samples.sort()
        median = statistics.median(samples)
        p95 = samples[int(len(samples) * 0.95) - 1]
        print(f"{label:<26}{median * 1000:>11.3f}{p95 * 1000:>9.3f}{median / base:>7.2f}x")


if __name__ == "__main__":
    main()
