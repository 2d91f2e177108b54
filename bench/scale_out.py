"""Scale-out: 50,000 no-op jobs drained by 1, 2, 4 and 8 worker processes; where it stops.

    .venv/bin/python bench/scale_out.py [--jobs 50000] [--processes 1 2 4 8] [--runs 3]
                                        [--concurrency 100 | --split 100] [--plot PATH]
                                        [--quick]

Each run empties the jobs table, enqueues the jobs (``bench.noop.v1``) and pauses their type,
starts the workers (``manage.py runworker --concurrency C``), waits until every one of them
has started and gone quiet, then resumes the type: the resume's NOTIFY wakes them all at
once, so no worker drains alone while the others are still starting up. The clock and every
counter run from that commit until a poll (every 20 ms) sees no job left. Process counts
alternate in order between runs (1, 2, 4, 8, then 8, 4, 2, 1), so a change in the machine's
load weighs on both ends of the curve; each figure is the median of its runs, with the
spread (max - min over the median) of jobs/s beside it.

Concurrency: ``--concurrency 100`` per process by default, the drain's best configuration
and what adding replicas does in production (each brings its own slots). ``--split TOTAL``
shares TOTAL slots among the processes instead (100: 100, 50, 25, 12), to tell what more
processes bring from what more slots bring.

Per process count it prints jobs/s (wall, and PostgreSQL's clock from the first claim to the
last outcome); CPU µs per job of the workers and of PostgreSQL (``_common.PostgresCpu``);
the cores busy on the whole machine and the busiest worker process, in cores; write
transactions and WAL flushes (``pg_stat_io``) per second and WAL bytes per job; connections
per worker process; what the bench database's backends were doing, sampled from
``pg_stat_activity`` every 50 ms (how many were in a statement on average, and of that time
the share on CPU and waiting on a lock, a lightweight lock or I/O, with the commonest wait
events); with ``pg_stat_statements``, the
statements that cost PostgreSQL the most per job; and a line saying where the bottleneck is.
It writes a PNG (matplotlib): jobs/s against processes with the line a linear scale-up from
1 process would draw, and CPU per job split into workers and PostgreSQL.

With DATABASE_URL unset it starts a PostgreSQL of its own (``_versus_server.BenchServer``, the
embedded binaries, initdb's defaults, ``pg_stat_statements`` loaded) and connects over its
Unix socket, so the server-wide counters (transaction ids, WAL, ``pg_stat_io``) count this
benchmark alone, not the tests of a development server; with DATABASE_URL set it uses that
server (``<db>_bench``), where those counters include whatever else runs there. Worker
"hosts" in network namespaces are not measured: on one machine they share its cores with
the server, and the TCP forwarder between them would be measured with the workers.

``--quick`` (2,000 jobs, 1 and 2 processes, one run) is the smoke run the tests make. The full
run (3 runs of each) takes about 3 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _common import (
    PostgresCpu,
    db_counters,
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
from _setup import ROOT
from _versus_server import BenchServer
from drain import db_span

NOOP = "bench.noop.v1"
#: What the bench database's backends are doing, read at every poll of the drain.
ACTIVITY = (
    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND backend_type = 'client backend'"
)
WAL_FLUSHES = "SELECT sum(fsyncs)::bigint FROM pg_stat_io WHERE object = 'wal'"
#: This script's own statements, left out of the statement table.
OWN = re.compile(
    r"pg_stat_|pg_snapshot_xmax|pg_backend_pid|GROUP BY state|FROM jobs_job WHERE state IN"
    r"|^(DELETE FROM jobs_pause|SELECT pg_notify|TRUNCATE|VACUUM|SHOW|SET|CREATE|LISTEN)"
)
#: Seconds between polls for the end, and between samples of pg_stat_activity: polling
#: every 10 ms and sampling at each poll cost 0.15 of a core, which the workers then lack.
POLL, SAMPLE = 0.02, 0.05
WAITS = ("Lock", "LWLock", "IO")  # pg_stat_activity's wait_event_type, as shown
PLOT = "scale-out.png"  # under var/bench/ unless --plot says where


@dataclass
class Run:
    """One drain: raw totals over the measured window."""

    processes: int
    concurrency: int
    jobs: int
    wall: float = 0.0
    span: float = 0.0
    worker_cpu: float = 0.0
    pg_cpu: float = 0.0
    machine_cpu: float = 0.0  # CPU seconds of every process on the machine
    own_cpu: float = 0.0  # this script's and its backend's (the polls)
    busiest: float = 0.0  # the busiest worker process, in cores
    xids: int = 0
    wal_bytes: int = 0
    wal_flushes: float = float("nan")
    connections: int = 0
    samples: int = 0
    waits: Counter[str] = field(default_factory=Counter)  # backends in a statement, by wait
    statements: list[tuple[str, int, float]] = field(default_factory=list)

    @property
    def others_cpu(self) -> float:
        """CPU seconds of every other process on the machine (a test run beside, say)."""
        return max(0.0, self.machine_cpu - self.worker_cpu - self.pg_cpu - self.own_cpu)

    @property
    def rate(self) -> float:
        return self.jobs / self.wall

    def per_job(self, seconds: float) -> float:
        return seconds * 1e6 / self.jobs

    def cores(self, seconds: float) -> float:
        return seconds / self.wall

    @property
    def active(self) -> float:
        """Backends in a statement, on average over the polls: PostgreSQL's concurrency."""
        return sum(self.waits.values()) / (self.samples or 1)

    def share(self, prefix: str) -> float:
        """Share of the in-statement samples in a state (``CPU``, ``Lock``, ``IO``, ...)."""
        total = sum(self.waits.values())
        return sum(n for k, n in self.waits.items() if k.startswith(prefix)) / (total or 1)


class Activity:
    """The probe of the drain's polls: tallies what the bench database's backends do."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.next = 0.0

    def __call__(self, cur: Any) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + SAMPLE
        cur.execute(ACTIVITY)
        rows = cur.fetchall()
        self.run.samples += 1
        self.run.connections = max(self.run.connections, len(rows))
        for state, kind, event in rows:
            if state != "active":  # idle: waiting for the worker's next statement
                continue
            if kind is None:
                self.run.waits["CPU"] += 1
            else:
                self.run.waits[f"{kind}:{event}"] += 1


def scalar(sql: str) -> Any:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(sql)
        return cur.fetchone()[0]


def has_statements() -> bool:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'")
        if cur.fetchone() is None:
            cur.execute("SHOW shared_preload_libraries")
            if "pg_stat_statements" not in cur.fetchone()[0]:
                return False
            cur.execute("CREATE EXTENSION pg_stat_statements")
    return True


def statements(jobs: int) -> list[tuple[str, int, float]]:
    """The workers' statements since the reset: (text, calls, planning + execution ms)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT query, calls, total_plan_time + total_exec_time FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY 3 DESC"
        )
        rows = cur.fetchall()
    return [(" ".join(q.split()), c, ms) for q, c, ms in rows if c and not OWN.search(q)]


def busy_seconds(times: Any) -> float:
    """CPU seconds the machine's cores were busy (guest time is inside user time already)."""
    spent = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return spent - times.idle - getattr(times, "iowait", 0.0)


def own(me: psutil.Process, pg: PostgresCpu) -> float:
    """CPU seconds of this script and of the backend serving its polls."""
    times = me.cpu_times()
    backend = pg.own_backend.cpu_times() if pg.own_backend is not None else None
    return times.user + times.system + (backend.user + backend.system if backend else 0.0)


def wal_flushes() -> int | None:
    """WAL flushes so far, server-wide (``pg_stat_io`` has them from PostgreSQL 16 on)."""
    if int(scalar("SHOW server_version_num")) < 160000:
        return None
    return int(scalar(WAL_FLUSHES))


def wait_quiet(workers: list, deadline: float = 15.0) -> None:
    """Wait until the workers' start-up is over: under 5 % of a core each for 0.2 s."""
    give_up = time.monotonic() + deadline
    before = [w.cpu() for w in workers]
    while time.monotonic() < give_up:
        time.sleep(0.2)
        now = [w.cpu() for w in workers]
        if all(b - a < 0.01 for a, b in zip(before, now, strict=True)):
            return
        before = now


def wait_disconnected(timeout: float = 10.0) -> None:
    """Wait until the stopped workers' backends exited (and so flushed their statistics)."""
    deadline = time.monotonic() + timeout
    while scalar(ACTIVITY.replace("state, wait_event_type, wait_event", "count(*)")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def drain(processes: int, concurrency: int, jobs: int, pg: PostgresCpu, stats: bool) -> Run:
    from jobs.queue import pauses

    run = Run(processes, concurrency, jobs)
    truncate()
    enqueue_noops(jobs)
    vacuum()
    pauses.pause("job_type", NOOP, by="bench/scale_out.py")
    me = psutil.Process()
    try:
        with running_workers(processes, ["--concurrency", str(concurrency)]) as workers:
            wait_quiet(workers)
            if stats:
                scalar("SELECT pg_stat_statements_reset() IS NOT NULL")
            scalar("SELECT pg_stat_force_next_flush() IS NULL")  # this backend's enqueue
            flushes = wal_flushes()
            cpu0 = [w.cpu() for w in workers]
            pg0, machine0, own0 = pg.total(exclude_self=True), psutil.cpu_times(), own(me, pg)
            xid0, wal0 = db_counters()
            started = time.monotonic()
            pauses.resume("job_type", NOOP)
            finished = wait_until_done(jobs, timeout=900, interval=POLL, probe=Activity(run))
            run.wall = finished - started
            cpus = [w.cpu() - c for w, c in zip(workers, cpu0, strict=True)]
            run.worker_cpu, run.busiest = sum(cpus), max(cpus) / run.wall
            run.pg_cpu = pg.total(exclude_self=True) - pg0
            machine1, own1 = psutil.cpu_times(), own(me, pg)
            run.machine_cpu = busy_seconds(machine1) - busy_seconds(machine0)
            run.own_cpu = own1 - own0
            xid1, wal1 = db_counters()
            run.xids, run.wal_bytes = xid1 - xid0, wal1 - wal0
            if stats:
                run.statements = statements(jobs)
    finally:
        pauses.resume("job_type", NOOP)
    wait_disconnected()
    if flushes is not None:
        run.wal_flushes = (wal_flushes() or 0) - flushes
    run.span = db_span()
    return run


# --- the report -------------------------------------------------------------------------------


def median(runs: list[Run], value: Any) -> float:
    return statistics.median(value(r) for r in runs)


def ceiling(run: Run, cores: int) -> float:
    """jobs/s the machine's cores would give if the workers and PostgreSQL had them all."""
    return cores * run.jobs / (run.worker_cpu + run.pg_cpu)


def bottleneck(runs: list[Run], cores: int) -> str:
    """Where the drain's time went: the cores, one worker's GIL, or the serial run loops."""
    busy = median(runs, lambda r: r.cores(r.machine_cpu))
    workers = median(runs, lambda r: r.cores(r.worker_cpu))
    pg = median(runs, lambda r: r.cores(r.pg_cpu))
    busiest = median(runs, lambda r: r.busiest)
    polls = median(runs, lambda r: r.cores(r.own_cpu))
    others = median(runs, lambda r: r.cores(r.others_cpu))
    shared = f"; other processes used {others:.2f} cores" if others >= 0.2 else ""
    lock = median(runs, lambda r: r.share("Lock") + r.share("LWLock"))
    io = median(runs, lambda r: r.share("IO"))
    inside = f"in statements {lock:.0%} of the time waiting on locks, {io:.0%} on WAL I/O"
    if busy >= 0.85 * cores:
        return (
            f"CPU: {busy:.2f} of {cores} cores busy (workers {workers:.2f}, PostgreSQL "
            f"{pg:.2f}, this script's polls {polls:.2f}, other processes {others:.2f}); {inside}"
        )
    if busiest >= 0.85:
        return (
            f"the worker process: the busiest used {busiest:.2f} of a core, and its threads "
            f"share one GIL ({busy:.2f} of {cores} cores busy{shared})"
        )
    active = median(runs, lambda r: r.active / r.processes)
    return (
        f"the run loops, one pass after the other: each had a statement in PostgreSQL "
        f"{active:.0%} of the time ({inside}) and ran its own Python the rest "
        f"({busy:.2f} of {cores} cores busy{shared})"
    )


def top_waits(runs: list[Run], count: int = 4) -> str:
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run.waits)
    everything = sum(total.values()) or 1
    waits = [(k, n) for k, n in total.most_common() if k != "CPU"][:count]
    return ", ".join(f"{k.split(':', 1)[1]} {n / everything:.1%}" for k, n in waits) or "-"


def label(text: str) -> str:
    """A short name for a worker statement (the full text is in the statements file)."""
    if text.startswith("WITH expired"):
        return "lease recovery"
    if "SKIP LOCKED" in text:
        return "claim (with the outcome flush)" if "unnest" in text else "claim"
    if "lease_expires_at" in text and text.startswith(("UPDATE", "WITH")):
        return "lease renewal" if "heartbeat_at" in text else "outcome / lease update"
    return text[:60]


def report(groups: dict[int, list[Run]], cores: int, stats: bool) -> None:
    rows, database = [], []
    for processes, runs in groups.items():
        rates = [r.rate for r in runs]
        rows.append(
            [
                processes,
                runs[0].concurrency,
                median(runs, lambda r: r.rate),
                f"{(max(rates) - min(rates)) / statistics.median(rates):.0%}",
                median(runs, lambda r: r.jobs / r.span),
                median(runs, lambda r: r.per_job(r.worker_cpu)),
                median(runs, lambda r: r.per_job(r.pg_cpu)),
                median(runs, lambda r: ceiling(r, cores)),
                median(runs, lambda r: r.cores(r.machine_cpu)),
                median(runs, lambda r: r.cores(r.others_cpu)),
                median(runs, lambda r: r.busiest),
            ]
        )
        database.append(
            [
                processes,
                median(runs, lambda r: r.xids / r.wall),
                median(runs, lambda r: r.wal_flushes / r.wall),
                median(runs, lambda r: r.wal_bytes / r.jobs),
                median(runs, lambda r: r.connections / r.processes),
                median(runs, lambda r: r.active),
                f"{median(runs, lambda r: r.share('CPU')):.0%}",
                *(f"{median(runs, lambda r, k=k: r.share(k)):.1%}" for k in WAITS),
                top_waits(runs),
            ]
        )
    headers = ["procs", "conc", "jobs/s", "spread", "db jobs/s", "worker µs/job", "PG µs/job"]
    headers += ["CPU ceiling jobs/s", f"cores busy /{cores}", "others' cores", "busiest worker"]
    print(table(headers, rows))
    print(
        "\nPostgreSQL: write transactions and WAL flushes (server-wide), and what the bench "
        "database's backends were doing at each poll: how many were in a statement on "
        "average, and what those were doing (on CPU or waiting)"
    )
    headers = ["procs", "write txn/s", "WAL flushes/s", "WAL B/job", "conns/proc"]
    print(table([*headers, "in statement", "on CPU", *WAITS, "commonest waits"], database))
    if stats:
        print_statements(groups)
    print("\nbottleneck:")
    base = statistics.median(r.rate for r in next(iter(groups.values())))
    first = next(iter(groups))
    for processes, runs in groups.items():
        gain = median(runs, lambda r: r.rate) / base
        print(
            f"  {processes} x {runs[0].concurrency}: {gain:.2f}x of {first} process(es)"
            f" ({gain * first / processes:.0%} of linear); {bottleneck(runs, cores)}"
        )


def print_statements(groups: dict[int, list[Run]]) -> None:
    rows, full = [], []
    for processes, runs in groups.items():
        merged: dict[str, list[Any]] = {}
        jobs = sum(r.jobs for r in runs)
        for run in runs:
            # Values are sent inline (client-side binding): one statement has many entries.
            for text, calls, ms in run.statements:
                entry = merged.setdefault(label(text), [0, 0.0, text])
                entry[0] += calls
                entry[1] += ms
        total = sum(ms for _, ms, _ in merged.values())
        rows.append([processes, "(all the workers' statements)", "", "", total * 1e3 / jobs])
        for name, (calls, ms, text) in sorted(merged.items(), key=lambda kv: -kv[1][1])[:4]:
            rows.append(["", name, calls / jobs, ms * 1e3 / calls, ms * 1e3 / jobs])
            full.append(f"-- {processes} processes, {name}: {calls} calls, {ms:.1f} ms\n{text}\n")
    print("\nstatements (pg_stat_statements: planning + execution):")
    print(table(["procs", "statement", "calls/job", "µs/call", "µs/job"], rows))
    path = out_path("scale-out-statements.txt")
    path.write_text("\n".join(full))
    print(f"full texts: {path.relative_to(ROOT)}")


def plot(groups: dict[int, list[Run]], path: Path, caption: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # the project logs INFO
    import matplotlib.pyplot as plt

    procs = list(groups)
    rates = [median(groups[p], lambda r: r.rate) for p in procs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5), width_ratios=[3, 2])
    for p in procs:
        left.scatter([p] * len(groups[p]), [r.rate for r in groups[p]], color="#9ab", s=18)
    left.plot(procs, rates, "o-", color="#1f5f9f", linewidth=2, label="median of the runs")
    for p, rate in zip(procs, rates, strict=True):
        left.annotate(
            f"{rate:,.0f}", (p, rate), textcoords="offset points", xytext=(0, 8), ha="center"
        )
    linear = [rates[0] * p / procs[0] for p in procs]
    first = f"{procs[0]} process" + ("es" if procs[0] > 1 else "")
    left.plot(procs, linear, "--", color="#999", label=f"linear from {first}")
    cores = psutil.cpu_count() or 1
    roof = [median(groups[p], lambda r: ceiling(r, cores)) for p in procs]
    left.plot(procs, roof, ":", color="#c05030", label=f"ceiling: {cores} cores / CPU per job")
    left.set_xscale("log", base=2)
    left.set_xticks(procs, [str(p) for p in procs])
    left.set_ylim(0, max(*rates, *roof) * 1.3)
    left.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    left.set_xlabel("worker processes")
    left.set_ylabel("jobs/s")
    left.set_title("Drain throughput")
    left.grid(True, alpha=0.3)
    left.legend(loc="upper left")
    worker = [median(groups[p], lambda r: r.per_job(r.worker_cpu)) for p in procs]
    pg = [median(groups[p], lambda r: r.per_job(r.pg_cpu)) for p in procs]
    at = range(len(procs))
    right.bar(at, worker, color="#e0a040", label="workers")
    right.bar(at, pg, bottom=worker, color="#4a8ac0", label="PostgreSQL")
    right.set_xticks(at, [str(p) for p in procs])
    right.set_xlabel("worker processes")
    right.set_ylabel("CPU µs per job")
    right.set_title("CPU per job")
    right.grid(True, axis="y", alpha=0.3)
    right.legend(loc="upper left")
    right.set_ylim(0, max(w + p for w, p in zip(worker, pg, strict=True)) * 1.35)
    fig.text(0.5, 0.01, caption, ha="center", fontsize=9, color="#444")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine() -> str:
    model = platform.processor()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    version = scalar("SHOW server_version").split()[0]
    return f"{psutil.cpu_count()} cores ({model}), PostgreSQL {version}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--runs", type=int, default=3)
    slots = parser.add_mutually_exclusive_group()
    slots.add_argument("--concurrency", type=int, default=100, help="per process")
    slots.add_argument("--split", type=int, help="total slots shared among the processes")
    parser.add_argument("--plot", type=Path, help=f"the PNG (default var/bench/{PLOT})")
    parser.add_argument("--quick", action="store_true", help="2,000 jobs, 1 and 2, one run")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.processes, args.runs = 2_000, [1, 2], 1
    server = None
    if not os.environ.get("DATABASE_URL"):
        server = BenchServer(preload="pg_stat_statements")
        server.start()
        os.environ["DATABASE_URL"] = server.url("unix")
    try:
        setup_bench()
        pg = PostgresCpu()
        stats = has_statements()
        cores = psutil.cpu_count() or 1
        groups: dict[int, list[Run]] = {p: [] for p in args.processes}
        for n in range(args.runs):
            for processes in args.processes if n % 2 == 0 else args.processes[::-1]:
                concurrency = args.split // processes if args.split else args.concurrency
                run = drain(processes, concurrency, args.jobs, pg, stats)
                groups[processes].append(run)
                print(
                    f"  run {n + 1}: {processes} x {concurrency}: {run.rate:,.0f} jobs/s, "
                    f"{run.per_job(run.worker_cpu + run.pg_cpu):.0f} µs CPU/job; other "
                    f"processes used {run.cores(run.others_cpu):.2f} cores",
                    file=sys.stderr,
                )
        truncate()
        where = "DATABASE_URL" if server is None else "the bench's own server, Unix socket"
        slots_text = f"{args.split} slots shared" if args.split else f"{args.concurrency} each"
        others = [r.cores(r.others_cpu) for runs in groups.values() for r in runs]
        caption = (
            f"{args.jobs:,} no-op jobs, concurrency {slots_text}, median of {args.runs} "
            f"run(s); other processes used {min(others):.2f}-{max(others):.2f} cores\n"
            f"{machine()}; {where}"
        )
        print(caption)
        report(groups, cores, stats)
        if not pg.available:
            print("(PostgreSQL CPU not measured: the server does not run on this machine)")
        if not stats:
            print("(pg_stat_statements not loaded on this server: no statement table)")
        path = args.plot or out_path(PLOT)
        plot(groups, path, caption)
        print(f"plot: {path}")
    finally:
        if server is not None:
            from django.db import connections

            connections.close_all()
            server.stop()
    return report_problems()


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"(ran {time.monotonic() - started:.0f}s)", file=sys.stderr)
    sys.exit(code)
