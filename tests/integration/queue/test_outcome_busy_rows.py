"""The outcome write looks for busy rows only when an outcome went unwritten.

The one-time filter ``(SELECT count(*) FROM written) < (SELECT count(*) FROM o)`` in the
``busy`` CTE must change nothing a batch reports or writes, on any of the paths that carry
the CTEs: ``record()`` counted and not, the inline pass, and the worker's pass functions
(``jobs_worker_pass_v3``, ``jobs_worker_fair_pass_v3``). It cannot: ``written`` has one row per
row updated, every such row was matched by outcomes of its id under its own token, and rows
of different ids are different outcomes; so ``count(written) = count(o)`` only when every
outcome's token is among the written ones, when the anti join finds nothing busy anyway.

These tests check that on generated batches, with rows another session really holds
locked: every path reports and writes the same, what ``jobs.queue.outcomes`` promises
(written, fenced, busy, stopped), and leaves the rows it did not write as they were.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome, OutcomeReport, flow
from jobs.queue.flow import FlowLimits
from tests.support.concurrency import Background
from tests.support.explain import explained_nested_statements

NAME = "test.busy.v1"
# Nothing is ever queued under these: a pass that writes outcomes and claims nothing.
IDLE = "test.busy.idle.v1"
FAIR_IDLE = "test.busy.fair.v1"
FAIR = {FAIR_IDLE: FlowLimits(fair=True)}
SCOPE = AllTenants()
BY = "operator@busy"
AT = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)

FILTER = re.compile(r"\(SELECT count\(\*\) FROM written\) < \(SELECT count\(\*\) FROM o\)\s+AND ")
PATHS = ("record", "record uncounted", "pass statement", "pass function", "fair pass function")
# What each path's one statement starts with (None: no statement for an empty batch).
CALLS = {
    "pass function": "SELECT * FROM jobs_worker_pass_v3(",
    "fair pass function": "SELECT * FROM jobs_worker_fair_pass_v3(",
}
# The functions the code calls.
FUNCTIONS = ("jobs_worker_pass_v3", "jobs_worker_fair_pass_v3")


def run(path: str, batch: list[Outcome]) -> OutcomeReport:
    with CaptureQueriesContext(connection) as statements:
        if path in ("record", "record uncounted"):
            report = queue.record(batch, count=path == "record")
        elif path == "pass statement":
            report, claimed = queue.record_and_claim(
                batch, [ClaimRequest(IDLE, 3)], scope=SCOPE, count=True
            )
            assert claimed == []
        else:
            name, limits = (IDLE, None) if path == "pass function" else (FAIR_IDLE, FAIR)
            report, claimed = queue.record_and_claim(
                batch, [ClaimRequest(name, 3)], scope=SCOPE, count=False, limits=limits
            )
            assert claimed == []
    sent = [s["sql"] for s in statements]
    if path in CALLS:  # the kept-plan function, even for an empty batch
        assert len(sent) == 1 and sent[0].startswith(CALLS[path]), sent
    elif batch:
        assert len(sent) == 1 and "busy AS" in sent[0], sent
    return report


def _rows(base: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """The jobs' rows, what a statement's clock puts in them made comparable."""
    rows = []
    for row in Job.objects.filter(name=NAME).order_by("id").values():
        row.pop("heartbeat_at", None)
        run_after = row.pop("run_after")
        row["run_after moved"] = base is not None and run_after != base[row["id"]]
        row["finished"] = row.pop("finished_at") is not None
        row["attempt_log"] = [
            {k: v for k, v in entry.items() if k != "ended_at"} for entry in row["attempt_log"]
        ]
        rows.append(row)
    return rows


class Locker:
    """Another session holding ``ids``' rows ``FOR UPDATE`` until :meth:`release`."""

    def __init__(self, ids: list[int]):
        self._locked, self._release = threading.Event(), threading.Event()
        self._ids = ids

        def hold() -> None:
            with transaction.atomic():
                list(Job.objects.select_for_update().filter(pk__in=ids).values_list("id"))
                self._locked.set()
                assert self._release.wait(60), "never released"

        self._thread = Background(hold)
        assert self._locked.wait(30), "the other session never locked the rows"

    def release(self) -> None:
        self._release.set()
        self._thread.result()


@dataclasses.dataclass
class World:
    """Committed jobs of NAME in the states a batch's outcomes may meet."""

    held: dict[int, Any]  # id -> the ClaimedJob of the first claim
    tokens: dict[int, uuid.UUID]  # id -> the token that holds the row now (running rows)
    locked: set[int]
    asked: set[int]


HISTORIES = ("held", "reclaimed", "moved", "finished")
KINDS = ("succeeded", "failed", "retry", "retry at", "released", "cancelled")


def build(jobs: list[tuple[str, bool, bool]]) -> World:
    """Each job's history since its first claim, whether an operator asked it to stop and
    whether another session holds its row locked (the lock is taken by the caller)."""
    ids = [e.id for e in queue.enqueue_many([NewJob(NAME, {})] * len(jobs))]
    held = {j.id: j for j in queue.claim([ClaimRequest(NAME, len(ids))], scope=SCOPE)}
    assert sorted(held) == sorted(ids)
    history = dict(zip(ids, (h for h, _, _ in jobs), strict=True))
    again = [i for i in ids if history[i] == "reclaimed"]
    if again:
        queue.record([Outcome.retry(held[i], code="again") for i in again])
        assert (
            sorted(j.id for j in queue.claim([ClaimRequest(NAME, len(again))], scope=SCOPE))
            == again
        )
    moved = [i for i in ids if history[i] == "moved"]  # a maintenance pass cleared the token
    Job.objects.filter(pk__in=moved).update(claim_token=None, state="queued")
    finished = [i for i in ids if history[i] == "finished"]
    queue.record([Outcome.succeeded(held[i]) for i in finished])
    asked = {i for i, (_, ask, _) in zip(ids, jobs, strict=True) if ask}
    queue.cancel_running(sorted(asked), by=BY)
    tokens = dict(Job.objects.filter(name=NAME, state="running").values_list("id", "claim_token"))
    locked = {i for i, (_, _, lock) in zip(ids, jobs, strict=True) if lock}
    return World(held, tokens, locked, asked)


def outcome(world: World, index: int, which: str, kind: str) -> Outcome:
    ids = sorted(world.held)
    job = world.held[ids[index % len(ids)]]
    made = {
        "succeeded": lambda: Outcome.succeeded(job, {"n": index}),
        "failed": lambda: Outcome.failed(job, code="boom", detail=f"broke {index}"),
        "retry": lambda: Outcome.retry(job, code="later", delay=60),
        "retry at": lambda: Outcome.retry(job, code="later", at=AT),
        "released": lambda: Outcome.released(job),
        "cancelled": lambda: Outcome.cancelled(job),
    }[kind]()
    if which == "current":  # the token holding the row now, if any holds it
        return dataclasses.replace(made, token=world.tokens.get(job.id, job.claim_token))
    if which == "stale":  # the first claim's token
        return made
    if which == "unknown id":
        return dataclasses.replace(made, id=max(ids) + 1000 + index, token=uuid.uuid4())
    return dataclasses.replace(made, token=uuid.uuid4())  # a token that matches nothing


def promised(world: World, batch: list[Outcome]) -> dict[str, Any]:
    """What jobs.queue.outcomes promises for ``batch``: written while the token holds the
    running row, busy while it holds it but another session has it locked, fenced otherwise;
    stopped when written as cancelled because an operator had asked."""
    live = [world.tokens.get(o.id) == o.token for o in batch]
    locked = [o.id in world.locked for o in batch]
    expected = {
        "applied": tuple(
            o.id for o, ok, lock in zip(batch, live, locked, strict=True) if ok and not lock
        ),
        "busy": tuple(o.id for o, ok, lock in zip(batch, live, locked, strict=True) if ok and lock),
        "fenced": tuple(o.id for o, ok in zip(batch, live, strict=True) if not ok),
    }
    # Duplicates of one token that disagree on stopping: which one is written is PostgreSQL's
    # pick (UPDATE … FROM), so only tokens whose outcomes all agree are promised.
    stopping: dict[uuid.UUID, set[bool]] = {}
    for o, ok, lock in zip(batch, live, locked, strict=True):
        if ok and not lock:
            stopping.setdefault(o.token, set()).add(
                o.id in world.asked and o.state in ("queued", "cancelled")
            )
    expected["stopped"] = {t: s.pop() for t, s in stopping.items() if len(s) == 1}
    return expected


def check_promise(world: World, batch: list[Outcome], report: OutcomeReport) -> None:
    expected = promised(world, batch)
    assert (report.applied, report.busy, report.fenced) == (
        expected["applied"],
        expected["busy"],
        expected["fenced"],
    )
    for token, stops in expected["stopped"].items():
        if stops:
            assert report.stopped[token] == f"cancelled while running, asked by {BY}"
        else:
            assert token not in report.stopped
    # Only a written outcome is ever stopped.
    assert set(report.stopped) <= report.applied_tokens


def compare_paths(world: World, batch: list[Outcome]) -> None:
    """Every path: the same report and the same rows, as promised, the rows it did not write
    as they were."""
    run_after = dict(Job.objects.filter(name=NAME).values_list("id", "run_after"))
    base = {row["id"]: row for row in _rows(run_after)}
    first = None
    for path in PATHS:
        with transaction.atomic():
            report = run(path, batch)
            rows = _rows(run_after)
            transaction.set_rollback(True)
        if first is None:
            first = (report, rows)
        assert (report, rows) == first, path
        check_promise(world, batch, report)
        written = set(report.applied)
        assert [row for row in rows if row["id"] not in written] == [
            base[row["id"]] for row in rows if row["id"] not in written
        ], path


def _clean() -> None:
    Job.objects.filter(name=NAME).delete()


@pytest.fixture
def fair_gate():
    flow.ensure(FAIR)


def _functions_have_the_filter() -> None:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT proname, prosrc FROM pg_proc WHERE proname = ANY(%s)", [list(FUNCTIONS)]
        )
        sources = dict(cur.fetchall())
    assert len(sources) == 2 and all(FILTER.search(s) for s in sources.values())


jobs_strategy = st.lists(
    st.tuples(st.sampled_from(HISTORIES), st.booleans(), st.booleans()), min_size=1, max_size=4
)
batch_strategy = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.sampled_from(["current", "current", "current", "stale", "random", "unknown id"]),
        st.sampled_from(KINDS),
    ),
    max_size=8,
)


@pytest.mark.django_db(transaction=True)
@example(jobs=[("held", False, False)] * 3, batch=[(0, "current", "succeeded")] * 2)  # duplicates
@example(  # a stale and a fresh attempt of one job
    jobs=[("reclaimed", False, False), ("held", False, False)],
    batch=[(0, "stale", "succeeded"), (0, "current", "failed"), (1, "current", "retry")],
)
@example(  # one row locked, every other outcome written
    jobs=[("held", False, True), ("held", False, False), ("held", False, False)],
    batch=[(0, "current", "succeeded"), (1, "current", "succeeded"), (2, "current", "failed")],
)
@example(  # a stale outcome of a locked row whose fresh attempt is in the batch too
    jobs=[("reclaimed", False, True), ("held", False, False)],
    batch=[(0, "stale", "succeeded"), (0, "current", "succeeded"), (1, "current", "succeeded")],
)
@example(  # two copies of a locked row's outcome beside one that is written
    jobs=[("held", False, True), ("held", False, False), ("held", False, False)],
    batch=[(0, "current", "succeeded"), (0, "current", "succeeded"), (1, "current", "succeeded")],
)
@example(  # an operator's cancel: a retry, a hand-back and a cancel end cancelled
    jobs=[("held", True, False), ("held", True, False), ("held", True, False)],
    batch=[(0, "current", "retry"), (1, "current", "released"), (2, "current", "cancelled")],
)
@example(jobs=[("held", False, False)], batch=[])  # an empty batch
@example(  # outcomes matching nothing, and a job already finished or moved
    jobs=[("finished", False, False), ("moved", True, True)],
    batch=[(0, "random", "succeeded"), (1, "unknown id", "failed"), (0, "current", "retry")],
)
@given(jobs=jobs_strategy, batch=batch_strategy)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_batch_reports_and_writes_the_same_on_every_path_as_promised(fair_gate, jobs, batch):
    _functions_have_the_filter()
    world = build(jobs)
    locker = Locker(sorted(world.locked)) if world.locked else None
    try:
        outcomes = [outcome(world, index, which, kind) for index, which, kind in batch]
        compare_paths(world, outcomes)
    finally:
        if locker is not None:
            locker.release()
        _clean()


def _anti_joins(plan: dict) -> list[dict]:
    def nodes(node: dict) -> list[dict]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    # "Right Anti" too (PostgreSQL 16 on), which the planner may pick by its estimates.
    return [n for n in nodes(plan) if n.get("Join Type", "").endswith("Anti")]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fenced", [False, True], ids=["written whole", "one fenced"])
@pytest.mark.parametrize("path", ["pass function", "fair pass function"])
def test_the_worker_functions_kept_plan_skips_the_anti_join_only_when_written_whole(
    fair_gate, path, fenced
):
    # The commit's plan test reads the inline statement's plan; the worker runs the
    # functions, on a generic plan each connection keeps. Their plans, from auto_explain.
    ids = [e.id for e in queue.enqueue_many([NewJob(NAME, {})] * 30)]
    held = queue.claim([ClaimRequest(NAME, 30)], scope=SCOPE)
    assert len(held) == len(ids)
    if fenced:
        Job.objects.filter(pk=held[0].id).update(claim_token=None, state="queued")
    batch = [Outcome.succeeded(h) for h in held]
    try:
        for _ in range(6):  # the kept plan is a generic one from the first call on
            with transaction.atomic(), explained_nested_statements() as plans:
                report = run(path, batch)
                transaction.set_rollback(True)
            assert len(report.applied) == 30 - fenced and not report.busy
            [plan] = [p for p in plans if "written AS" in p.get("Query Text", "")]
            anti = _anti_joins(plan["Plan"])
            assert anti, json.dumps(plan, indent=1)
            loops = {n["Actual Loops"] for n in anti}
            assert loops == ({1} if fenced else {0}), json.dumps(plan, indent=1)
    finally:
        _clean()


def _busy_through_function(path: str) -> OutcomeReport:
    ids = [e.id for e in queue.enqueue_many([NewJob(NAME, {})] * 3)]
    held = queue.claim([ClaimRequest(NAME, 3)], scope=SCOPE)
    assert len(held) == len(ids)
    locker = Locker([held[0].id])
    try:
        batch = [Outcome.succeeded(h) for h in held] + [Outcome.failed(held[1], code="late")]
        return run(path, batch)
    finally:
        locker.release()
        _clean()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", list(CALLS))
def test_the_worker_functions_report_a_row_another_session_holds_as_busy(fair_gate, path):
    report = _busy_through_function(path)
    assert len(report.busy) == 1 and len(report.applied) == 3
