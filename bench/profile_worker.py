"""Where a worker spends its time while draining no-op jobs, and what PostgreSQL spends.

    .venv/bin/pip install py-spy   # measurement only, not a project requirement
    .venv/bin/python bench/profile_worker.py [--jobs 20000] [--concurrency 100] [--top 12]
    .venv/bin/python bench/profile_worker.py --type sleep --jobs 10000 --skip py-spy cprofile

Four parts, each on a freshly filled bench table (``<db>_bench``, emptied first), each with
one ``runworker --concurrency C`` process draining ``--jobs`` no-op jobs (``--type`` drains
another of ``bench/drain.py``'s job types, e.g. ``sleep`` for handlers that wait on I/O):

1. The control loop, instrumented (``BENCH_TRACE``, see ``bench/benchapp/trace.py``): wall
   time of its passes split into outcome flush, claim, commit, dispatch and waiting, with
   call counts and batch sizes; per job, the delay from claim to handler start and from
   handler end to the flushed outcome. PostgreSQL CPU per connection of the same run (the
   worker's control connection, lease keeper, listener, this script's poller, background
   processes).
2. ``py-spy`` (``--gil --nonblocking``: samples of whichever thread holds the GIL, i.e. Python
   CPU, without pausing the process) per thread group (control loop, handler pool, lease
   keeper, listener): top functions by own and by cumulative time.
3. ``cProfile`` (on Python 3.12+ it sees every thread) with call counts and time per call of
   the run loop's steps, and the top functions by own time.
4. ``EXPLAIN (ANALYZE, BUFFERS)`` of the statements the queue API runs at realistic sizes,
   captured from the real calls with an execute wrapper (each statement is explained in a
   savepoint that is rolled back, then run for real): enqueue of a batch, claim, lease
   renewal and outcome flush, on a table of ``--jobs`` queued jobs. Prints planning and
   execution time next to the client's round trip, and the claim and outcome plans.

Files land in ``var/bench/``: ``trace.json``, ``worker-gil.txt`` (py-spy raw collapsed
stacks, for flamegraph.pl or speedscope), ``worker.prof`` (pstats), ``plans.txt``.
``--skip trace py-spy cprofile explain`` leaves parts out.
"""

from __future__ import annotations

import argparse
import json
import pstats
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from _common import (
    PYTHON,
    UNFINISHED,
    PostgresCpu,
    enqueue_noops,
    out_path,
    report_problems,
    running_workers,
    setup_bench,
    table,
    truncate,
    vacuum,
    wait_until_done,
)

NAME = "bench.noop.v1"


#: The job type drained (``--type``): a key of ``bench/benchapp/jobs.py``'s kinds.
KIND = "noop"


def fill(jobs: int) -> None:
    truncate()
    enqueue_noops(jobs, kind=KIND)
    vacuum()


# -- py-spy ---------------------------------------------------------------------------------


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    return found if Path(found).exists() else None


def thread_group(name: str) -> str:
    if name.startswith("jobs-handler"):
        return "handler pool"
    return {
        "MainThread": "control loop (main thread)",
        "jobs-lease-keeper": "lease keeper",
        "jobs-listener": "NOTIFY listener",
    }.get(name, "other threads")


def parse_raw(path: Path) -> dict[str, Counter[tuple[str, ...]]]:
    """py-spy raw output: ``thread (tid): name;frame;…;frame count`` per line."""
    stacks: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
    for line in path.read_text().splitlines():
        body, _, count = line.rpartition(" ")
        head, *frames = body.split(";")
        frames = frames or ["<no Python frame>"]
        name = head.partition(": ")[2] if head.startswith("thread") else head
        main = "main (manage.py)" in frames or "<module> (manage.py)" in frames
        if main:
            # Only the worker's run: drop the main thread's Django start-up and shutdown.
            if "Worker.run (jobs/worker/runner.py)" not in frames:
                continue
            name = "MainThread"
        stacks[thread_group(name)][tuple(frames)] += int(count)
    return stacks


def summarize(stacks: dict[str, Counter[tuple[str, ...]]], top: int, what: str) -> None:
    total = sum(sum(c.values()) for c in stacks.values())
    print(f"samples by thread group ({what}):")
    rows = []
    for group, counter in sorted(stacks.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(counter.values())
        rows.append([group, n, f"{100 * n / total:.1f}%"])
    print(table(["thread group", "samples", "share"], rows))
    for group, counter in sorted(stacks.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(counter.values())
        if n < total * 0.02:
            continue
        own: Counter[str] = Counter()
        cumulative: Counter[str] = Counter()
        for frames, count in counter.items():
            if not frames:
                continue
            own[frames[-1]] += count
            for frame in set(frames):
                cumulative[frame] += count
        print(f"\n{group}: {n} samples")
        print(
            table(
                ["own %", "function (own time)"],
                [[f"{100 * c / n:.1f}", f] for f, c in own.most_common(top)],
            )
        )
        skip = ("_bootstrap", "_bootstrap_inner", "run (threading", "<module>", "main (manage")
        cum = [(f, c) for f, c in cumulative.most_common() if not f.startswith(skip)]
        print(
            table(
                ["cum %", "function (cumulative)"],
                [[f"{100 * c / n:.1f}", f] for f, c in cum[:top]],
            )
        )


def label_backend(query: str) -> str:
    q = " ".join(query.split())
    if "FOR UPDATE SKIP LOCKED" in q or "SET state = o.state" in q:
        return "worker control loop (claim + outcomes)"
    if "heartbeat_at = statement_timestamp()" in q and "l(id, token)" in q:
        return "worker lease keeper (renew)"
    if q.startswith("LISTEN"):
        return "worker NOTIFY listener"
    if UNFINISHED in q or "pg_stat_activity" in q:
        return "this script (poller)"
    if q in ("BEGIN", "COMMIT", "ROLLBACK", ""):
        return ""  # says nothing about the connection
    if "jobs_job" in q:
        return "worker control loop (maintenance)"
    return "other: " + q[:40]


def backend_labels() -> dict[int, str]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return {pid: label_backend(query) for pid, query in cur.fetchall()}


def drain_with_backends(pg: PostgresCpu, jobs: int) -> tuple[float, dict[str, float]]:
    """Poll until drained, sampling which backend runs what; returns (seconds, CPU by label)."""
    from django.db import connection

    before = pg.backends()
    total_before = pg.total()
    votes: dict[int, Counter[str]] = defaultdict(Counter)
    started = time.monotonic()
    polls = 0
    with connection.cursor() as cur:
        while True:
            if polls % 10 == 0:
                for pid, label in backend_labels().items():
                    votes[pid][label] += 1 if label else 0
            polls += 1
            cur.execute(UNFINISHED)
            if not cur.fetchone()[0]:
                break
            if time.monotonic() - started > 120:
                raise SystemExit("the worker did not drain the queue within 120 s")
            time.sleep(0.01)
    elapsed = time.monotonic() - started
    after = pg.backends()
    total = pg.total() - total_before
    own = {}
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        own[cur.fetchone()[0]] = "this script (poller)"
    by_label: Counter[str] = Counter()
    for pid, cpu in after.items():
        delta = cpu - before.get(pid, 0.0)
        if pid in own:
            label = own[pid]
        elif pid in votes:
            # Between statements the control connection shows COMMIT, saying nothing; the only
            # worker connection that commits explicit transactions is its control loop.
            named = [(lab, n) for lab, n in votes[pid].most_common() if lab]
            label = named[0][0] if named else "worker control loop (claim + outcomes)"
        else:
            label = _aux_label(pid)
        by_label[label] += delta
    if abs(rest := total - sum(by_label.values())) >= 0.0005:
        by_label["postmaster, exited backends"] = rest
    return elapsed, dict(by_label)


def _aux_label(pid: int) -> str:
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "gone"
    cmd = cmd.removeprefix("postgres: ")
    if "jobs_bench" in cmd or "[local]" in cmd:
        return "other backends"
    return "server: " + re.sub(r"\s+\d+$", "", cmd).strip()


def profile_trace(pg: PostgresCpu, jobs: int, concurrency: int) -> None:
    fill(jobs)
    path = out_path("trace.json")
    path.unlink(missing_ok=True)
    env = {"BENCH_TRACE": str(path)}
    sessions_before = session_times()
    with running_workers(1, ["--concurrency", str(concurrency)], env=env) as (worker,):
        before = worker.proc.cpu_times()
        elapsed, by_label = drain_with_backends(pg, jobs)
        after = worker.proc.cpu_times()
        worker_cpu = after.user + after.system - before.user - before.system
        time.sleep(0.05)  # let the worker go idle before it is stopped
    time.sleep(0.2)  # the worker's backends report their session times as they exit
    sessions = {k: v - sessions_before[k] for k, v in session_times().items()}
    data = json.loads(path.read_text())
    totals, calls, sizes = data["totals"], data["calls"], data["sizes"]
    print("\n=== 1. control loop, instrumented ===")
    print(
        f"drained {jobs:,} jobs in {elapsed:.2f}s ({jobs / elapsed:,.0f} jobs/s), worker CPU "
        f"{worker_cpu * 1e6 / jobs:.0f} µs/job (user {(after.user - before.user) * 1e6 / jobs:.0f}"
        f", system {(after.system - before.system) * 1e6 / jobs:.0f}); the loop ran "
        f"{totals['run (whole)']:.2f}s until stopped (a little longer than the drain)"
    )
    run = totals["run (whole)"]
    rows = []
    order = [
        "pass (whole)",
        "outcomes + claim (SQL)",
        "record outcomes (SQL)",
        "claim (SQL)",
        "commit",
        "outcomes + claim (SQL): waiting for PostgreSQL",
        "record outcomes (SQL): waiting for PostgreSQL",
        "claim (SQL): waiting for PostgreSQL",
        "commit: waiting for PostgreSQL",
        "dispatch to pool",
        "settle acks",
        "maintenance",
        "take acks",
        "claim requests",
    ]
    for name in order:
        if name not in totals:
            continue
        n = calls[name]
        rows.append(
            [
                name,
                n,
                totals[name],
                f"{100 * totals[name] / run:.1f}%",
                totals[name] / n * 1e6,
                sizes[name] / n if sizes.get(name) else "",
                totals[name] / jobs * 1e6,
            ]
        )
    accounted = sum(totals[k] for k in order[1:] if k in totals and "waiting" not in k)
    rows.append(
        ["pass: rest (BEGIN, Python glue)", "", totals["pass (whole)"] - accounted, "", "", "", ""]
    )
    rows.append(["outside passes (waiting)", "", run - totals["pass (whole)"], "", "", "", ""])
    print(
        table(
            ["step (control thread)", "calls", "s", "of run", "µs/call", "avg batch", "µs/job"],
            rows,
        )
    )
    print(
        table(
            ["per job", "jobs", "p50 ms", "p90 ms", "p99 ms"],
            [
                [name, v["n"], v["p50"] * 1000, v["p90"] * 1000, v["p99"] * 1000]
                for name, v in data["jobs"].items()
            ],
        )
    )
    control = by_label.get("worker control loop (claim + outcomes)", 0.0)
    print(
        "\nPostgreSQL sessions of the bench database over the run (pg_stat_database, ms): "
        f"active {sessions['active_time']:,.0f}, idle in transaction "
        f"{sessions['idle_in_transaction_time']:,.0f}; CPU of the worker's control "
        f"connection {control * 1000:,.0f}. Active time that is not CPU is time the backend "
        "waited to be scheduled or for I/O (WAL flush at commit)."
    )
    pg_total = sum(by_label.values())
    print(f"\nPostgreSQL CPU during the drain: {pg_total * 1e6 / jobs:.0f} µs/job")
    print(
        table(
            ["connection / process", "CPU s", "µs/job", "share"],
            [
                [label, cpu, cpu * 1e6 / jobs, f"{100 * cpu / pg_total:.0f}%"]
                for label, cpu in sorted(by_label.items(), key=lambda kv: -kv[1])
                if abs(cpu) >= 0.0005
            ],
        )
    )


def session_times() -> dict[str, float]:
    """Milliseconds the bench database's sessions spent active and idle in a transaction."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT pg_stat_force_next_flush()")
        cur.execute(
            "SELECT active_time, idle_in_transaction_time FROM pg_stat_database "
            "WHERE datname = current_database()"
        )
        active, idle = cur.fetchone()
    return {"active_time": float(active), "idle_in_transaction_time": float(idle)}


def profile_py_spy(jobs: int, concurrency: int, top: int, rate: int) -> None:
    spy = py_spy()
    if spy is None:
        print("\npy-spy is not installed: .venv/bin/pip install py-spy (skipping part 2)")
        return
    fill(jobs)
    path = out_path("worker-gil.txt")
    # --gil: only samples of the thread holding the GIL, i.e. running Python (py-spy's idle
    # detection counts threads blocked on the handler queue as busy). --nonblocking: do not
    # stop the process's 100+ threads for every sample, which slows the drain 7-fold.
    prefix = [spy, "record", "--format", "raw", "--nolineno", "--threads", "--gil"]
    prefix += ["--nonblocking", "-r", str(rate), "-o", str(path), "--"]
    with running_workers(1, ["--concurrency", str(concurrency)], prefix=prefix) as (worker,):
        cpu_before = worker.cpu()
        started = time.monotonic()
        wait_until_done(jobs, timeout=120)
        elapsed = time.monotonic() - started
        worker_cpu = worker.cpu() - cpu_before
    print("\n=== 2. py-spy: Python CPU (samples of the GIL holder) ===")
    print(
        f"drained {jobs:,} jobs in {elapsed:.2f}s under py-spy ({jobs / elapsed:,.0f} jobs/s), "
        f"worker CPU {worker_cpu * 1e6 / jobs:.0f} µs/job, raw profile {path}\n"
    )
    summarize(parse_raw(path), top, "GIL holder")


# -- cProfile -------------------------------------------------------------------------------


def profile_cprofile(jobs: int, concurrency: int, top: int) -> None:
    fill(jobs)
    path = out_path("worker.prof")
    python_args = ["-m", "cProfile", "-o", str(path)]
    with running_workers(1, ["--concurrency", str(concurrency)], python_args=python_args):
        started = time.monotonic()
        finished = wait_until_done(jobs, timeout=120)
    print(f"\n=== 3. cProfile ({jobs:,} jobs in {finished - started:.2f}s, {path}) ===")
    stats = pstats.Stats(str(path))
    entries = stats.stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    interesting = [
        ("runner.py", "_pass"),
        ("runner.py", "_take_acks"),
        ("runner.py", "_claim"),
        ("runner.py", "_dispatch"),
        ("runner.py", "_settle"),
        ("runner.py", "_maintain"),
        ("claim.py", "claim"),
        ("outcomes.py", "record"),
        ("utils.py", "execute"),
        ("base.py", "commit"),
        ("transaction.py", "__enter__"),
        ("transaction.py", "__exit__"),
        ("pool.py", "submit"),
        ("execution.py", "make_context"),
    ]
    rows = []
    for (file, _line, func), (_cc, calls, own, cum, _callers) in entries.items():
        for suffix, name in interesting:
            if (
                file.endswith(suffix)
                and func == name
                and ("django" in file) == (name in ("execute", "commit", "__enter__", "__exit__"))
            ):
                rows.append([f"{Path(file).parent.name}/{Path(file).name}:{func}", calls, own, cum])
    rows.sort(key=lambda r: -r[3])
    print(
        table(
            ["function", "calls", "own s", "cum s", "cum µs/call", "µs/job"],
            [[*r, r[3] / max(r[1], 1) * 1e6, r[3] / jobs * 1e6] for r in rows],
        )
    )
    print(
        "\ntop by own time (all threads, whole run incl. start-up; blocking C calls such as "
        "psycopg's wait and SimpleQueue.get count their waiting too):"
    )
    _print_pstats(stats, "tottime", top)


def _print_pstats(stats: pstats.Stats, key: str, top: int, restrict: str = "") -> None:
    rows = []
    for (file, line, func), (_cc, calls, own, cum, _c) in stats.stats.items():
        if restrict and not re.search(restrict, file):
            continue
        if func in ("run_from_argv", "execute", "handle", "run") and "jobs/" not in file:
            continue
        short = re.sub(r".*/site-packages/", "", file)
        short = re.sub(rf"^{re.escape(str(Path(__file__).resolve().parent.parent))}/", "", short)
        rows.append([f"{short}:{line}({func})", calls, own, cum])
    rows.sort(key=lambda r: -(r[2] if key == "tottime" else r[3]))
    print(table(["function", "calls", "own s", "cum s"], rows[:top]))


# -- EXPLAIN ANALYZE ------------------------------------------------------------------------


class Explainer:
    """An execute wrapper: EXPLAIN ANALYZE each statement in a savepoint, then run it."""

    def __init__(self) -> None:
        self.label = ""
        self.results: list[dict] = []

    def __call__(self, execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("COPY"):  # no plan to show: EXPLAIN refuses COPY
            return execute(sql, params, many, context)
        raw = context["cursor"].cursor  # the psycopg cursor (no wrappers, no recursion)
        if isinstance(raw, _Replay):  # an earlier statement on this cursor left its stand-in
            raw = raw._cursor
        raw.execute("SAVEPOINT bench_explain")
        raw.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql, params)
        plan = "\n".join(row[0] for row in raw.fetchall())
        raw.execute("ROLLBACK TO SAVEPOINT bench_explain")
        started = time.perf_counter()
        result = execute(sql, params, many, context)
        rows = raw.fetchall() if raw.description else []
        round_trip = time.perf_counter() - started
        # Give the rows back to the caller: run the statement's fetch again from a copy.
        context["cursor"].cursor = _Replay(raw, rows)
        self.results.append(
            {"label": self.label, "plan": plan, "round_trip": round_trip, "rows": len(rows)}
        )
        return result


class _Replay:
    """Stands in for the psycopg cursor after the wrapper consumed its rows."""

    def __init__(self, cursor, rows) -> None:
        self._cursor = cursor
        self._rows = rows

    def fetchall(self):
        rows, self._rows = self._rows, []
        return rows

    def fetchone(self):
        return self._rows.pop(0) if self._rows else None

    def __getattr__(self, name):
        return getattr(self._cursor, name)


def explain(jobs: int, sizes: list[int], enqueue_batch: int) -> None:
    from django.db import connection, transaction

    from jobs import queue
    from jobs.queue import AllTenantsExcept, ClaimRequest, Outcome

    fill(jobs)
    scope = AllTenantsExcept("worker")
    explainer = Explainer()
    rows = []
    for size in sizes:
        for attempt in range(2):  # the first round warms this backend's caches
            explainer.results.clear()
            with transaction.atomic():
                with connection.execute_wrapper(explainer):
                    explainer.label = f"enqueue_many ({enqueue_batch} jobs)"
                    enqueue_noops(enqueue_batch, batch=enqueue_batch)
                    explainer.label = f"claim {size} of {jobs:,} queued"
                    claimed = queue.claim(
                        [ClaimRequest(NAME, size, 3)], scope=scope, limit=size, worker="bench"
                    )
                    explainer.label = f"renew {size} leases"
                    queue.renew(claimed)
                    explainer.label = f"record {size} outcomes"
                    queue.record([Outcome.succeeded(job, time.time()) for job in claimed])
                transaction.set_rollback(True)
            if attempt == 0:
                continue
            for result in explainer.results:
                planning = _ms(result["plan"], "Planning Time")
                execution = _ms(result["plan"], "Execution Time")
                rows.append(
                    [
                        result["label"],
                        result["rows"],
                        planning,
                        execution,
                        result["round_trip"] * 1000,
                        result["round_trip"] * 1000 - planning - execution,
                    ]
                )
            last = list(explainer.results)
    print(f"\n=== 4. PostgreSQL: the queue's statements on {jobs:,} queued jobs ===")
    print(
        table(
            ["statement", "rows", "plan ms", "exec ms", "round trip ms", "rest ms"],
            rows,
        )
    )
    print(
        "(round trip: the real statement's execute + fetch, timed in this process; "
        "rest = round trip - planning - execution: parsing, transfer, psycopg)"
    )
    path = out_path("plans.txt")
    with path.open("w") as out:
        for result in last:
            out.write(f"-- {result['label']}\n{result['plan']}\n\n")
    for result in last:
        if result["label"].startswith(("claim", "record")):
            print(f"\n-- {result['label']}\n{result['plan']}")
    print(f"\n(all plans: {path})")


def _ms(plan: str, what: str) -> float:
    match = re.search(rf"{what}: ([\d.]+) ms", plan)
    return float(match.group(1)) if match else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--top", type=int, default=12, help="functions listed per table")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[5, 50],
        help="claim/outcome batch sizes to EXPLAIN (a worker of concurrency C claims and "
        "acknowledges about C/2 at a time while busy)",
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["trace", "py-spy", "cprofile", "explain"]
    )
    parser.add_argument(
        "--type",
        choices=["noop", "touch", "append", "sleep", "asleep"],
        default="noop",
        help="job type bench.TYPE.v1 drained (as bench/drain.py's --type)",
    )
    args = parser.parse_args()
    global KIND
    KIND = args.type
    setup_bench()
    pg = PostgresCpu()
    print(f"worker: runworker --concurrency {args.concurrency}, {args.jobs:,} bench.{KIND}.v1 jobs")
    if "trace" not in args.skip:
        profile_trace(pg, args.jobs, args.concurrency)
    if "py-spy" not in args.skip:
        profile_py_spy(args.jobs, args.concurrency, args.top, args.rate)
    if "cprofile" not in args.skip:
        profile_cprofile(args.jobs, args.concurrency, args.top)
    if "explain" not in args.skip:
        explain(args.jobs, args.sizes, 1000)
    truncate()
    return report_problems()


if __name__ == "__main__":
    sys.exit(main())
