"""What a job's row life costs PostgreSQL per job, and what other row lives would cost.

    .venv/bin/python bench/row_life.py [--jobs 30000] [--batch 250] [--runs 3]

A drain of no-op jobs costs PostgreSQL more CPU per job for ``jobs`` than for pgqueuer (see
``bench/versus.py``). This script measures where: on the scratch database (``<db>_bench``,
emptied first) it fills ``jobs_job`` with ``--jobs`` queued keyless jobs, the same rows for
every variant, then claims them ``--batch`` at a time and finishes each batch, one statement
after the other on one connection, and reads the CPU of that connection's backend (from
/proc) and the WAL it wrote. Variants, each on a fresh table, alternating, ``--runs`` times,
median:

- ``pass``: the worker's own statement (``jobs.queue.record_and_claim``: the outcomes of one
  batch written and the next batch claimed together), as ``runworker`` runs it;
- ``two updates``: the same row life in two plain statements, the claim (``FOR UPDATE SKIP
  LOCKED``, then the update to ``running``) and the finish (lock, then the update to
  ``succeeded``); the baseline of the ratios;
- ``finish unlocked``: the finish updates without locking the rows first (it would then wait
  for rows another session holds instead of skipping them);
- ``finish moves``: the finish deletes the rows and inserts them into a history table of the
  same columns (pgqueuer's row life: the queue holds only unfinished work);
- ``no key lock``: keyless rows do not hold their generated key (``key_held`` false, and the
  check constraint that active rows hold it dropped for the run), so neither the insert nor
  the claim writes an entry in the key lock's unique index;
- ``moves, no key lock``: both.

Only ``pass`` is what ``jobs`` does; the others are experiments on the scratch database, which
the script restores (the constraint, the history table) however it ends. The figures say what
a different design would save, not what ``jobs`` costs in production.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _common import setup_bench, table, truncate

NAME = "bench.noop.v1"

# The same rows for every variant, as COPY writes keyless jobs (jobs.queue.enqueue).
FILL = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
                      replayed_by, created_at, fair)
SELECT gen_random_uuid()::text, %(name)s, jsonb_build_object('n', g), '', 'default', 0, 3,
       statement_timestamp(), 'queued', 0, '', '', '', %(held)s, FALSE, '',
       statement_timestamp(), FALSE
FROM generate_series(1, %(count)s) AS g
"""

CLAIM = """
WITH picked AS (
    SELECT id FROM jobs_job
    WHERE state = 'queued' AND name = %(name)s AND run_after <= statement_timestamp()
    ORDER BY priority DESC, run_after, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs_job j
SET state = 'running', attempts = j.attempts + 1, claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + interval '10 seconds',
    heartbeat_at = statement_timestamp(), started_at = statement_timestamp(),
    claimed_by = 'bench'
FROM picked WHERE j.id = picked.id
RETURNING j.id, j.claim_token
"""

_HELD = """
held AS (
    SELECT j.id FROM jobs_job j
    JOIN unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS o(id, token) ON j.id = o.id
    WHERE j.claim_token = o.token AND j.state || '' = 'running'
    FOR UPDATE OF j SKIP LOCKED
)"""

_FINISHED = """
SET state = 'succeeded', finished_at = statement_timestamp(), claim_token = NULL,
    lease_expires_at = NULL, key_held = j.keyed"""

FINISH_UPDATE = f"WITH {_HELD}\nUPDATE jobs_job j {_FINISHED}\nFROM held WHERE j.id = held.id"

FINISH_UNLOCKED = f"""
UPDATE jobs_job j {_FINISHED}
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS o(id, token)
WHERE j.id = o.id AND j.claim_token = o.token AND j.state || '' = 'running'
"""

FINISH_MOVE = f"""
WITH {_HELD},
gone AS (DELETE FROM jobs_job j USING held WHERE j.id = held.id RETURNING j.*)
INSERT INTO bench_row_life_history SELECT * FROM gone
"""

KEY_CONSTRAINT = "jobs_job_active_holds_key"
HEADERS = (
    *("row life", "claim µs/job", "finish µs/job", "total µs/job"),
    *("ratio", "WAL B/job", "jobs/s"),
)


@dataclass(frozen=True)
class Variant:
    label: str
    finish: str | None  # the statement that finishes a batch; None: the worker's own pass
    key_lock: bool = True  # whether keyless rows hold their generated key


VARIANTS = [
    Variant("pass", None),
    Variant("two updates", FINISH_UPDATE),
    Variant("finish unlocked", FINISH_UNLOCKED),
    Variant("finish moves", FINISH_MOVE),
    Variant("no key lock", FINISH_UPDATE, False),
    Variant("moves, no key lock", FINISH_MOVE, False),
]
BASELINE = "two updates"


def backend_cpu(pid: int) -> Callable[[], float]:
    """CPU seconds of the backend so far: the scheduler's nanoseconds where Linux gives them
    (a statement takes a few milliseconds, less than the 10 ms tick of the usual counters)."""
    schedstat = Path(f"/proc/{pid}/schedstat")
    if schedstat.exists():
        return lambda: int(schedstat.read_text().split()[0]) / 1e9
    import psutil

    process = psutil.Process(pid)
    return lambda: sum(process.cpu_times()[:2])


def wal_position(cur) -> int:
    cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
    return int(cur.fetchone()[0])


def fill(cur, count: int, *, key_lock: bool, constraint: str) -> None:
    """The queued rows, vacuumed, after a checkpoint (each variant writes the same first-touch
    page images)."""
    truncate()
    cur.execute("TRUNCATE bench_row_life_history")
    if key_lock:
        cur.execute(
            f"ALTER TABLE jobs_job DROP CONSTRAINT IF EXISTS {KEY_CONSTRAINT}, "
            f"ADD CONSTRAINT {KEY_CONSTRAINT} {constraint}"
        )
    else:
        cur.execute(f"ALTER TABLE jobs_job DROP CONSTRAINT IF EXISTS {KEY_CONSTRAINT}")
    cur.execute(FILL, {"name": NAME, "held": key_lock, "count": count})
    cur.execute("VACUUM ANALYZE jobs_job")
    cur.execute("CHECKPOINT")


def drain_in_statements(cur, variant: Variant, batch: int, cpu: Callable[[], float]):
    claim_cpu = finish_cpu = 0.0
    done = 0
    while True:
        before = cpu()
        cur.execute(CLAIM, {"name": NAME, "batch": batch})
        rows = cur.fetchall()
        claimed = cpu()
        if not rows:
            return claim_cpu, finish_cpu, done
        cur.execute(variant.finish, {"ids": [r[0] for r in rows], "tokens": [r[1] for r in rows]})
        claim_cpu += claimed - before
        finish_cpu += cpu() - claimed
        done += len(rows)


def drain_by_pass(batch: int) -> int:
    from jobs.queue import AllTenants, ClaimRequest, Outcome, record_and_claim

    requests = [ClaimRequest(NAME, batch)]
    held: list = []
    done = 0
    while True:
        outcomes = [Outcome.succeeded(job) for job in held]
        _, held = record_and_claim(outcomes, requests, scope=AllTenants(), count=False)
        done += len(outcomes)
        if not held:
            return done


def run(variant: Variant, args: argparse.Namespace, constraint: str) -> dict[str, float]:
    from django.db import connection

    with connection.cursor() as cur:
        fill(cur, args.jobs, key_lock=variant.key_lock, constraint=constraint)
        cur.execute("SELECT pg_backend_pid()")
        cpu = backend_cpu(cur.fetchone()[0])

        wal_before, cpu_before, started = wal_position(cur), cpu(), time.perf_counter()
        if variant.finish is None:
            done = drain_by_pass(args.batch)
            claim_cpu = finish_cpu = float("nan")
        else:
            claim_cpu, finish_cpu, done = drain_in_statements(cur, variant, args.batch, cpu)
        elapsed, total_cpu = time.perf_counter() - started, cpu() - cpu_before
        wal = wal_position(cur) - wal_before
    if done != args.jobs:
        raise SystemExit(f"{variant.label}: {done} jobs finished, {args.jobs} queued")
    return {
        "claim": claim_cpu / done * 1e6,
        "finish": finish_cpu / done * 1e6,
        "total": total_cpu / done * 1e6,
        "wal": wal / done,
        "rate": done / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=30_000)
    parser.add_argument("--batch", type=int, default=250, help="jobs claimed per statement")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    setup_bench()
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = %s",
            [KEY_CONSTRAINT],
        )
        (constraint,) = cur.fetchone()
        cur.execute(
            "CREATE TABLE IF NOT EXISTS bench_row_life_history (LIKE jobs_job INCLUDING DEFAULTS);"
            "ALTER TABLE bench_row_life_history DROP CONSTRAINT IF EXISTS bench_row_life_pk;"
            "ALTER TABLE bench_row_life_history ADD CONSTRAINT bench_row_life_pk PRIMARY KEY (id)"
        )
    results: dict[str, list[dict[str, float]]] = {v.label: [] for v in VARIANTS}
    try:
        for number in range(1, args.runs + 1):
            for variant in VARIANTS:
                results[variant.label].append(run(variant, args, constraint))
                figures = results[variant.label][-1]
                print(
                    f"run {number}: {variant.label}: {figures['total']:.1f} µs/job, "
                    f"{figures['wal']:.0f} WAL bytes/job",
                    flush=True,
                )
    finally:
        truncate()
        with connection.cursor() as cur:
            cur.execute(
                f"ALTER TABLE jobs_job DROP CONSTRAINT IF EXISTS {KEY_CONSTRAINT}, "
                f"ADD CONSTRAINT {KEY_CONSTRAINT} {constraint}"
            )
            cur.execute("DROP TABLE IF EXISTS bench_row_life_history")

    def med(label: str, field: str) -> float:
        return statistics.median(r[field] for r in results[label])

    base = med(BASELINE, "total")
    rows = [
        [
            v.label,
            med(v.label, "claim"),
            med(v.label, "finish"),
            med(v.label, "total"),
            med(v.label, "total") / base,
            med(v.label, "wal"),
            med(v.label, "rate"),
        ]
        for v in VARIANTS
    ]
    print(
        f"\n{args.jobs:,} jobs, {args.batch} a statement, one connection; PostgreSQL CPU of its "
        f"backend, median of {args.runs}; ratio against '{BASELINE}'\n"
    )
    print(
        table(
            [
                "row life",
                "claim µs/job",
                "finish µs/job",
                "total µs/job",
                "ratio",
                "WAL B/job",
                "jobs/s",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
