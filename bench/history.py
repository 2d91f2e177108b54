"""Where finished jobs should live: 10 M finished rows in the jobs table, or in the history.

    .venv/bin/python bench/history.py [--finished 10000000] [--expired 1000000] [--quick]

Builds the same finished rows (with ``generate_series``) two ways in a scratch database
(``<db>_bench_history``): as terminal rows of ``jobs_job`` (the layout before the history
table) and as rows of the partitioned ``jobs_jobhistory``, with the oldest ``--expired`` of
them past their retention. Beside them sit 10,000 due queued jobs. For each layout it
measures the claim (p50 and p99 of 100 claims of 50, each rolled back), retention of the
expired rows (``queue.prune``'s batched deletes against ``history.drop_expired``'s partition
drops), the ``VACUUM`` of ``jobs_job`` that follows (what autovacuum must then do), and the
size of ``jobs_job`` with its indexes. It also times the archive pass moving 100,000 freshly
finished rows out of ``jobs_job``. Figures are printed with the history/jobs-table ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

from _setup import setup

QUEUED = 10_000
FRESH = 100_000

# Finished rows, the first ``expired`` of them two hours past a 24-hour retention, the rest
# spread over the last 23 hours.
FINISHED_COLUMNS = """
    job_id, name, payload, tenant, queue, priority, max_attempts, run_after, state, attempts,
    last_error, error_detail, claimed_by, keyed, replayed_by, created_at, started_at,
    finished_at
"""
FINISHED_VALUES = """
SELECT 'done-' || g, 'bench.noop.v1', '{"n": 1}', 'default', 'default', 0, 5, t, 'succeeded',
       1, '', '', 'bench', FALSE, '', t, t, t
FROM (
    SELECT g, CASE WHEN g <= %(expired)s
                   THEN now() - interval '26 hours' + (g %% 3600) * interval '1 second'
                   ELSE now() - (g %% 82800) * interval '1 second' END AS t
    FROM generate_series(1, %(count)s) AS g
) AS rows
"""
INTO_JOBS = f"INSERT INTO jobs_job ({FINISHED_COLUMNS}, key_held) " + FINISHED_VALUES.replace(
    "t, t, t\n", "t, t, t, FALSE\n"
)
INTO_HISTORY = f"INSERT INTO jobs_jobhistory ({FINISHED_COLUMNS}, id) " + FINISHED_VALUES.replace(
    "t, t, t\n", "t, t, t, nextval(pg_get_serial_sequence('jobs_job', 'id'))\n"
)
QUEUE = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
                      replayed_by, created_at)
SELECT 'due-' || g, 'bench.noop.v1', '{"n": 1}', 'default', 'default', 0, 5, now(), 'queued',
       0, '', '', '', TRUE, FALSE, '', now()
FROM generate_series(1, %(count)s) AS g
"""
JUST_FINISHED = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
                      replayed_by, created_at, started_at, finished_at)
SELECT 'fresh-' || g, 'bench.noop.v1', '{"n": 1}', 'default', 'default', 0, 5, now(),
       'succeeded', 1, '', '', 'bench', FALSE, FALSE, '', now(), now(),
       now() - interval '1 minute'
FROM generate_series(1, %(count)s) AS g
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=10_000_000)
    parser.add_argument("--expired", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 finished, 10,000 expired")
    args = parser.parse_args()
    if args.quick:
        args.finished, args.expired = 100_000, 10_000
    setup("_bench_history")
    results = {layout: measure(layout, args.finished, args.expired) for layout in LAYOUTS}
    report(results, args)


LAYOUTS = ("jobs table", "history")


def measure(layout: str, finished: int, expired: int) -> dict[str, float]:
    """Build one layout and take its figures."""
    from django.db import connection

    from jobs.queue import history

    figures: dict[str, float] = {}
    with connection.cursor() as cur:
        reset(cur)
        started = time.perf_counter()
        if layout == "history":
            cur.execute("SELECT now()")
            (now,) = cur.fetchone()
            history.ensure(cur, "succeeded", now - timedelta(hours=27), now)
            cur.execute(INTO_HISTORY, {"count": finished, "expired": expired})
        else:
            cur.execute(INTO_JOBS, {"count": finished, "expired": expired})
        cur.execute(QUEUE, {"count": QUEUED})
        cur.execute("VACUUM ANALYZE jobs_job")
        if layout == "history":
            cur.execute("ANALYZE jobs_jobhistory")
        figures["build s"] = time.perf_counter() - started
    figures["claim p50 ms"], figures["claim p99 ms"] = claims()
    started = time.perf_counter()
    if layout == "history":
        removed = sum(history.drop_expired().values())
    else:
        from jobs import queue

        removed = sum(queue.prune(batch_size=1000, max_batches=10**6).values())
    figures["retention s"] = time.perf_counter() - started
    figures["rows retired"] = removed
    with connection.cursor() as cur:
        started = time.perf_counter()
        cur.execute("VACUUM jobs_job")
        figures["vacuum s"] = time.perf_counter() - started
        cur.execute("SELECT pg_total_relation_size('jobs_job') / 1048576.0")
        (figures["jobs_job MB"],) = cur.fetchone()
    figures["claim after p50 ms"], _p99 = claims()
    if layout == "history":
        with connection.cursor() as cur:
            cur.execute(JUST_FINISHED, {"count": FRESH})
        started = time.perf_counter()
        moved = 0
        while True:
            counts = history.archive()
            if not counts:
                break
            moved += sum(taken for taken, _kept in counts.values())
        elapsed = time.perf_counter() - started
        figures["archive rows/s"] = moved / elapsed if elapsed else 0.0
    return figures


def reset(cur) -> None:
    cur.execute("TRUNCATE jobs_job")
    cur.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = 'jobs_jobhistory_succeeded'::regclass"
    )
    for (name,) in cur.fetchall():
        cur.execute(f"DROP TABLE {name}")


def claims(count: int = 100) -> tuple[float, float]:
    """p50 and p99 (ms) of ``count`` claims of 50, each in a transaction rolled back."""
    from django.db import transaction

    from jobs.queue import AllTenants, ClaimRequest, claim

    times = []
    for _ in range(count):
        with transaction.atomic():
            started = time.perf_counter()
            claimed = claim([ClaimRequest("bench.noop.v1", 50)], scope=AllTenants(), worker="b")
            times.append((time.perf_counter() - started) * 1000)
            assert len(claimed) == 50, len(claimed)
            transaction.set_rollback(True)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1]


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"{args.finished:,} finished rows ({args.expired:,} past retention), "
        f"{QUEUED:,} queued; history / jobs table"
    )
    keys = list(dict.fromkeys(k for figures in results.values() for k in figures))
    print(f"{'':22}" + "".join(f"{layout:>14}" for layout in LAYOUTS) + f"{'ratio':>9}")
    for key in keys:
        values = [results[layout].get(key) for layout in LAYOUTS]
        cells = "".join(f"{'—' if v is None else f'{v:,.2f}':>14}" for v in values)
        old, new = values
        ratio = f"{new / old:.3f}x" if old and new is not None else ""
        print(f"{key:22}{cells}{ratio:>9}")


if __name__ == "__main__":
    main()
