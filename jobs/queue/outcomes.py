"""Fenced outcome writes: complete, retry, fail, release.

Over 400 lines: the outcome write's CTEs and the functions that send them are read together.

Every write is conditional on the claim token the worker got at claim time::

    UPDATE … WHERE id = $id AND claim_token = $token AND state = 'running'

A worker whose lease expired and whose job was taken by another worker (new token) or moved by
a maintenance pass (token cleared) matches nothing: its outcome changes nothing and is reported
as *fenced*. Outcomes of many jobs are written in one statement (``UPDATE … FROM unnest(…)``)
so a busy worker acknowledges in batches instead of one commit per job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.utils import timezone

from jobs.core.progress import Progress
from jobs.db import bounds as dbbounds
from jobs.queue import _db, attempts, bound, flow, history, rollup, text
from jobs.queue._arrays import Array, array
from jobs.queue.bound import RunRows
from jobs.queue.types import ClaimedJob, Outcome, OutcomeReport, clamp_delay

# What a stopped attempt's error says (the row's columns before the write).
_STOPPED_DETAIL = "('cancelled while running, asked by ' || j.cancel_requested_by)"

# What the write sets where an attempt ends, for the row that stays (``updated``) and the one
# that leaves for the history (``moved``) alike: ``j`` the row as it was, ``f`` its outcome.
_WRITTEN = {
    "attempts": "j.attempts + f.attempts_delta",
    # A hand-back ran nothing: its claim is no attempt's start (jobs.queue.attempts).
    "started_at": "CASE WHEN f.attempts_delta < 0 THEN NULL ELSE j.started_at END",
    "last_error": "CASE WHEN f.stopped THEN 'cancelled' ELSE COALESCE(f.code, j.last_error) END",
    "error_detail": (
        f"CASE WHEN f.stopped THEN {_STOPPED_DETAIL} ELSE COALESCE(f.detail, j.error_detail) END"
    ),
    "result": "f.result",
    # The handler's last progress report, if the lease renewals had not written it.
    "progress": "COALESCE(f.report, j.progress)",
}
# A row that leaves, as its history row: what the write sets, and the rest as it was (an
# ending attempt adds nothing to the log: it stays in the columns, jobs.queue.attempts).
_MOVED = ",\n              ".join(
    f"{_WRITTEN[column]} AS {column}"
    if column in _WRITTEN
    else {
        "state": "f.state AS state",
        "finished_at": "statement_timestamp() AS finished_at",
    }.get(column, f"j.{column}")
    for column in history.COLUMNS.split(", ")
)

# The outcome write's CTEs: the outcomes, the rows still held under their tokens (rows another
# session holds locked are skipped and reported busy, never waited for), and the write. A job
# that ends moves its batch's counts (the settle trigger, jobs.queue.batches): ``settling``
# locks those batch rows first. In the worker's pass it skips the ones another session holds
# (members being added, a sibling's jobs.complete() in its own transaction), and their members
# are busy too, so the pass never waits for a lock. The jobs waiting for one that ends are
# released after it, in bounded steps (jobs.queue.dependencies.release); ``settles`` says one
# is pending. The busy rows are looked for only when some outcome went unwritten: in passes
# of 100 the comparison of every outcome with every written one was 6 % of PostgreSQL's CPU.
# {FIGURES} and {COUNTED} are where the rollup's figures go when the statement counts.
#
# ``o`` keeps the later of two outcomes for one attempt (a batch sent again), for any caller:
# each row is then held and written once, with one outcome's values (the join that wrote it
# before could take the later's state with the earlier's error). ``free`` holds each outcome
# whose row is still held under its token (a stale attempt's outcome in the same batch as the
# fresh one's matches nothing) with the values the write needs, so the write joins those rows
# to the table by key alone. Joined to the outcomes again, under a plan made when few rows
# were running, it compared every outcome with every held row, a cost in the square of the
# batch: passes of 1,000 took 150 µs of PostgreSQL's CPU a job instead of 23. (Comments here
# go to the server with every statement, and its activity view shows only a statement's first
# 1,024 bytes: keep them short.) Both look their rows up by key: ``state || ''`` keeps the
# planner off the running index, which under the same plan it read whole every pass, every
# running row of the fleet (with 2,000 held by other workers, 8 µs more of PostgreSQL's CPU
# a job in passes of 50).
_OUTCOME_CTES = (
    """{FIRST}
o AS (
    -- Of two outcomes for one attempt, the later.
    SELECT DISTINCT ON (o.id, o.token) * FROM unnest(
        %(ids)b::bigint[], %(tokens)b::uuid[], %(states)b::text[], %(codes)b::text[],
        %(details)b::text[], %(delays)b::float8[], %(ats)b::timestamptz[], %(deltas)b::int[],
        %(results)b::jsonb[], %(reports)b::jsonb[]
    ) WITH ORDINALITY AS o(id, token, state, code, detail, delay, at, attempts_delta, result,
                           report, ord)
    ORDER BY o.id, o.token, o.ord DESC
),
free AS (
    -- An attempt an operator asked to stop is not retried or handed back: it ends cancelled.
    SELECT j.id, o.token, o.code, o.detail, o.delay, o.at, o.attempts_delta, o.result,
           o.report, j.batch_id, s.state,
           j.cancel_requested_at IS NOT NULL
               AND (o.state IN ('queued', 'cancelled')) AS stopped, l.leaves{FIGURES}
    FROM jobs_job j JOIN o ON j.id = o.id
    CROSS JOIN LATERAL (
        SELECT CASE WHEN j.cancel_requested_at IS NOT NULL AND o.state = 'queued'
                    THEN 'cancelled' ELSE o.state END AS state
    ) s
    CROSS JOIN LATERAL (
        -- Ends, and leaves for the history: keyless, in no batch, waited for by none.
        SELECT s.state <> 'queued' AND NOT j.keyed AND j.batch_id IS NULL
               AND NOT j.depended_on AND s.state = ANY({READY}) AS leaves
    ) l
    WHERE j.claim_token = o.token AND j.state || '' = 'running'{FIRST_READ}
    FOR UPDATE OF j SKIP LOCKED
),
settling AS MATERIALIZED (
    -- Batches whose counts an ending member moves, locked without waiting.
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT f.batch_id FROM free f WHERE f.state <> 'queued')
    FOR NO KEY UPDATE OF b{SKIP}
),
moved AS (
    -- A job that leaves: its row as the write below would have left it, into the history.
    DELETE FROM jobs_job j USING free f
    WHERE j.id = f.id AND f.leaves
    RETURNING {MOVED},
              f.token, f.stopped, f.attempts_delta{MOVED_FIGURES}
),
archived AS (
    INSERT INTO jobs_jobhistory ({HISTORY}) SELECT {HISTORY} FROM moved
),
unlinked AS (
    -- What a finished job waited for matters no more once it leaves (jobs.queue.dependencies).
    DELETE FROM jobs_dependency d WHERE d.job IN (SELECT m.id FROM moved m)
),
updated AS (
    UPDATE jobs_job j
    SET state = f.state,
        attempts = {SET_attempts},
        run_after = CASE WHEN f.state = 'queued'
                         THEN COALESCE(f.at, statement_timestamp() + make_interval(secs => f.delay))
                         ELSE j.run_after END,
        finished_at = CASE WHEN f.state = 'queued' THEN NULL ELSE statement_timestamp() END,
        started_at = {SET_started_at},
        last_error = {SET_last_error},
        error_detail = {SET_error_detail},
        result = {SET_result},
        progress = {SET_progress},
        claim_token = NULL,
        lease_expires_at = NULL,
        -- Only a key the caller chose is held, while the job is active and through its
        -- window (a keyless row enqueued by an earlier release held its key while active).
        key_held = j.keyed,
        -- A finished job keeps the identity of the worker that finished it.
        claimed_by = CASE WHEN f.state = 'queued' THEN '' ELSE j.claimed_by END,
        -- Back in the queue in its type's order now: tenant order may have begun meanwhile.
        fair = CASE WHEN f.state = 'queued' THEN """
    + flow.FAIR_AT_ENQUEUE.format(name="j.name")
    + """ ELSE j.fair END,
        -- An attempt that sends the job back to the queue goes to the log; one that ends
        -- the job stays in the columns (jobs.queue.attempts). A hand-back ran nothing.
        attempt_log = CASE WHEN f.state = 'queued' AND f.attempts_delta >= 0
            THEN j.attempt_log || """
    + attempts.entry_sql(row="j", outcome="'retry'", code="f.code", error="f.detail")
    + """ ELSE j.attempt_log END
    FROM free f
    WHERE j.id = f.id AND NOT f.leaves
      AND (f.batch_id IS NULL OR f.state = 'queued' OR f.batch_id IN (SELECT id FROM settling))
    RETURNING j.id, f.token, CASE WHEN f.stopped THEN j.error_detail END AS stopped,
              j.depended_on AND f.state <> 'queued' AS settles,
              j.name AS wname, j.tenant AS wtenant{COUNTED}
),
written AS (
    SELECT id, token, stopped, settles, wname, wtenant{COUNTED_NAMES} FROM updated
    UNION ALL
    SELECT id, token, CASE WHEN stopped THEN error_detail END, FALSE, name, tenant{MOVED_COUNTED}
    FROM moved
),
-- Held under their token but not written: another session holds the row locked. Looked
-- for only when some outcome was not written: comparing each outcome with every written one
-- costs the square of the batch.
busy AS (
    SELECT o.id, o.token FROM o
    WHERE (SELECT count(*) FROM written) < (SELECT count(*) FROM o)
      AND NOT EXISTS (SELECT 1 FROM written w WHERE w.token = o.token)
      AND EXISTS (
          SELECT 1 FROM jobs_job j
          WHERE j.id = o.id AND j.claim_token = o.token AND j.state || '' = 'running'
      )
)
"""
)
# For the rollup: the attempt's run time and queue latency (as the claim has it), and what
# it ended as. Left out of statements that do not count: the worker counts its own.
_FIGURES = """,
           GREATEST(0, EXTRACT(EPOCH FROM statement_timestamp() - j.started_at))::float8 AS ran,
           GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8 AS waited"""
_COUNTED = """,
              j.name, f.state, j.last_error AS code, f.attempts_delta >= 0 AS ran_attempt,
              CASE WHEN f.attempts_delta >= 0 THEN f.ran END AS ran, f.waited"""
# The rollup's columns of ``written``, from the rows that stay and from those that leave.
_COUNTED_NAMES = ", name, state, code, ran_attempt, ran, waited"
_MOVED_COUNTED = """, name, state, last_error, attempts_delta >= 0,
           CASE WHEN attempts_delta >= 0 THEN ran END, waited"""
#: The outcome write's CTEs, ``True`` with the figures the rollup's CTE reads. As a statement of
#: its own (:func:`record`) it waits for a batch row another session holds, as long as the
#: connection's lock timeout allows; in the worker's pass (``PASS_OUTCOME_CTES``) it never
#: waits, and the members are busy.
# Waiting, it locks the batch rows first, before the jobs' own rows (jobs.queue.batches.
# lock_for says why): ``free`` reads ``batches_first`` in a condition that depends on no row,
# which PostgreSQL evaluates once, before the scan that locks the jobs. The jobs are read by
# key: COALESCE keeps the planner from inferring ``batch_id IS NOT NULL``, the predicate of
# the batch members' partial index, which it could then read whole.
_BATCHES_FIRST = """
batches_first AS MATERIALIZED (
    SELECT b.id FROM jobs_batch b
    WHERE b.id IN (SELECT COALESCE(j.batch_id, 0) FROM jobs_job j
                   WHERE j.id = ANY(%(ids)b::bigint[]))
    ORDER BY b.id
    FOR NO KEY UPDATE OF b
),"""


def _outcome_ctes(count: bool, wait: bool) -> str:
    text = _OUTCOME_CTES
    for column, expression in _WRITTEN.items():
        text = text.replace(f"{{SET_{column}}}", expression)
    return (
        text.replace("{FIGURES}", _FIGURES if count else "")
        .replace("{COUNTED}", _COUNTED if count else "")
        .replace("{COUNTED_NAMES}", _COUNTED_NAMES if count else "")
        .replace("{MOVED_COUNTED}", _MOVED_COUNTED if count else "")
        .replace("{MOVED_FIGURES}", ", f.ran, f.waited" if count else "")
        .replace("{MOVED}", _MOVED)
        .replace("{READY}", history.READY_STATES)
        .replace("{HISTORY}", history.COLUMNS)
        .replace("{FIRST}", _BATCHES_FIRST if wait else "")
        .replace(
            "{FIRST_READ}", "\n      AND (SELECT count(*) FROM batches_first) >= 0" if wait else ""
        )
        .replace("{SKIP}", "" if wait else " SKIP LOCKED")
    )


OUTCOME_CTES = {count: _outcome_ctes(count, wait=True) for count in (True, False)}
PASS_OUTCOME_CTES = {count: _outcome_ctes(count, wait=False) for count in (True, False)}
# The console's history: the attempts written, per type, outcome and error code, added to
# this minute's rollup rows in the same statement. A hand-back ran nothing and is not
# counted, unless an operator's cancel ended the job there (counted, with no run time). The
# worker counts its own outcomes instead (``count=False``, jobs.worker.history).
ROLLUP_CTE = rollup.cte(
    """
    SELECT name, CASE state WHEN 'queued' THEN 'retried' ELSE state END,
           CASE WHEN state = 'succeeded' THEN '' ELSE code END, ran, waited
    FROM written WHERE ran_attempt OR state <> 'queued'"""
)

_REPORT = (
    "SELECT token, TRUE, stopped, settles FROM written{} "
    "UNION ALL SELECT token, FALSE, NULL, FALSE FROM busy"
)
_RECORD = {
    True: f"WITH {OUTCOME_CTES[True]}, {ROLLUP_CTE} " + _REPORT.format(f" WHERE {rollup.reads()}"),
    False: f"WITH {OUTCOME_CTES[False]} " + _REPORT.format(""),
}
# The same, never waiting for a batch row (the worker's pass when it claims nothing).
_RECORD_SKIPPING = {
    True: f"WITH {PASS_OUTCOME_CTES[True]}, {ROLLUP_CTE} "
    + _REPORT.format(f" WHERE {rollup.reads()}"),
    False: f"WITH {PASS_OUTCOME_CTES[False]} " + _REPORT.format(""),
}

# Error details are for people reading the admin; keep a runaway traceback from bloating rows.
MAX_DETAIL = 8000


def record(
    outcomes: Sequence[Outcome],
    *,
    count: bool = True,
    wait: bool = True,
    runs: RunRows | None = None,
    lock_wait: float | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> OutcomeReport:
    """Write many outcomes in one statement; report which were applied, fenced or busy.

    *Busy* outcomes were not written because another session holds their row locked (an
    operator's open transaction, say): the caller tries them again later. With ``count``
    the attempts written are added to the console's history in the same statement; a caller
    that counts them itself (the worker) passes False. An ending batch member waits for its
    batch's row, unless ``wait`` is False: then it is busy while another session holds it.

    ``runs`` names the bound run rows of the outcomes' jobs, by claim token: those of the
    outcomes applied follow them in the same transaction (:mod:`jobs.queue.bound`). With
    ``lock_wait`` (seconds) the write waits at most that long for a lock, in a transaction
    of its own (or the caller's).
    """
    if not outcomes:
        return OutcomeReport((), ())
    if lock_wait is not None or bound.involved(outcomes, runs):
        with transaction.atomic(using=using):
            if lock_wait is not None:
                dbbounds.wait_for_locks(lock_wait, using=using)
            report = record(outcomes, count=count, wait=wait, using=using)
            if runs:
                bound.settle(outcomes, report, runs, using=using)
        return report
    statement = (_RECORD if wait else _RECORD_SKIPPING)[count]
    with _db.bound_cursor(using) as cur:
        cur.execute(statement, outcome_params(outcomes, using))
        rows = cur.fetchall()
    return outcome_report(
        outcomes,
        applied={token for token, written, _, _ in rows if written},
        busy={token for token, written, _, _ in rows if not written},
        stopped={
            token: detail for token, written, detail, _ in rows if written and detail is not None
        },
        settle=any(settles for _, _, _, settles in rows),
    )


def outcome_params(outcomes: Sequence[Outcome], using: str) -> dict[str, Any]:
    """The parameters of the outcome write's CTEs (also for :mod:`jobs.queue.cycle`)."""
    # The Outcome constructors already made these storable; an Outcome built by hand is
    # made so here, since one refused value would fail the whole batch. A naive retry time
    # is read in the connection's time zone, as PostgreSQL reads a naive literal.
    zone = connections[using].timezone
    outcomes = _last_of_each_attempt(outcomes)
    return {
        "ids": array("bigint", [o.id for o in outcomes]),
        "tokens": array("uuid", [o.token for o in outcomes]),
        "states": array("text", [o.state for o in outcomes]),
        "codes": array(
            "text", [None if o.code is None else text.clean(o.code)[:32] for o in outcomes]
        ),
        "details": array(
            "text", [None if o.detail is None else _bounded(o.detail) for o in outcomes]
        ),
        "delays": array("float8", [clamp_delay(o.delay) for o in outcomes]),
        # A NULL array (no outcome has a time, a result or a report) reads as NULL for
        # every outcome: unnest pads it.
        "ats": _nullable(
            "timestamptz",
            [
                o.at if o.at is None or timezone.is_aware(o.at) else timezone.make_aware(o.at, zone)
                for o in outcomes
            ],
        ),
        "deltas": array("integer", [o.attempts_delta for o in outcomes]),
        "results": _nullable("jsonb", [o.result_json for o in outcomes]),
        "reports": _nullable("jsonb", [o.progress_json for o in outcomes]),
    }


def _last_of_each_attempt(outcomes: Sequence[Outcome]) -> Sequence[Outcome]:
    """One outcome an attempt: of two for the same row and token (a batch sent again, or one
    built by hand), the later, as the statement keeps it for any caller (processes of the
    previous release too); not sending the other saves its bytes. The report still names
    every outcome given."""
    last = {(o.id, o.token): o for o in outcomes}
    return outcomes if len(last) == len(outcomes) else list(last.values())


def _nullable(kind: str, values: list[Any]) -> Array | list[Any] | None:
    """The array of ``values``, or None (a NULL array) when none of them is set."""
    return None if all(value is None for value in values) else array(kind, values)


def report_json(report: Progress) -> str:
    """A progress report as the ``progress`` column stores it, its note made storable."""
    data = report.as_json()
    data["note"] = text.clean(report.note)
    return text.dumps(data)


def with_progress(outcome: Outcome, report: Progress | None) -> Outcome:
    """``outcome`` carrying the handler's last report, which no lease renewal wrote."""
    if report is None:
        return outcome
    return dataclasses.replace(outcome, progress_json=report_json(report))


def outcome_report(
    outcomes: Sequence[Outcome],
    *,
    applied: set[UUID],
    busy: set[UUID],
    stopped: Mapping[UUID, str] | None = None,
    settle: bool = False,
) -> OutcomeReport:
    """Which outcomes (by claim token) were written, fenced or busy, in the outcomes' order."""
    # One pass, each token looked up once or twice: hashing a UUID is a Python call, and a
    # busy worker reports a hundred outcomes a pass.
    written: list[int] = []
    fenced: list[int] = []
    held: list[int] = []
    for outcome in outcomes:
        token = outcome.token
        if token in applied:
            written.append(outcome.id)
            if busy and token in busy:
                held.append(outcome.id)
        elif busy and token in busy:
            held.append(outcome.id)
        else:
            fenced.append(outcome.id)
    return OutcomeReport(
        applied=tuple(written),
        fenced=tuple(fenced),
        busy=tuple(held),
        applied_tokens=frozenset(applied),
        busy_tokens=frozenset(busy),
        stopped=dict(stopped or {}),
        settle=settle,
    )


def _bounded(detail: str) -> str:
    """At most MAX_DETAIL characters, keeping the end: a traceback's last line says most."""
    if len(detail) > MAX_DETAIL:
        head = MAX_DETAIL // 4
        marker = f"\n… ({len(detail) - MAX_DETAIL + 40} characters cut) …\n"
        marker = marker.ljust(40)[:40]
        tail = MAX_DETAIL - head - len(marker)
        detail = f"{detail[:head]}{marker}{detail[-tail:]}"
    return text.clean(detail)


def complete(job: ClaimedJob, result: Any = None, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Mark a claimed job succeeded; False if fenced out (the lease was lost).

    Raises :class:`~jobs.queue.InvalidResult` when ``result`` is not storable JSON.
    """
    return _one(Outcome.succeeded(job, result), using)


def retry(
    job: ClaimedJob,
    *,
    code: str,
    detail: str = "",
    delay: timedelta | float = 0.0,
    at: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> bool:
    """Put a claimed job back in the queue, due after ``delay`` (or at ``at``)."""
    return _one(Outcome.retry(job, code=code, detail=detail, delay=delay, at=at), using)


def fail(job: ClaimedJob, *, code: str, detail: str = "", using: str = DEFAULT_DB_ALIAS) -> bool:
    """Mark a claimed job failed with an error code from the outcome table."""
    return _one(Outcome.failed(job, code=code, detail=detail), using)


def release(
    jobs: Sequence[ClaimedJob], *, runs: RunRows | None = None, using: str = DEFAULT_DB_ALIAS
) -> OutcomeReport:
    """Hand claimed jobs back untried (graceful shutdown): due at once, attempt returned.

    Their bound run rows (``runs``, as for :func:`record`) are queued again with them."""
    return record([Outcome.released(job) for job in jobs], runs=runs, using=using)


def _one(outcome: Outcome, using: str) -> bool:
    return bool(record([outcome], using=using).applied)
