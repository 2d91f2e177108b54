"""A worker's pass in one statement: write the finished jobs' outcomes and claim the next.

Written as separate statements in a transaction, a pass costs four round trips (BEGIN, the
outcome write, the claim, COMMIT) and two plans. As one statement in autocommit it is one
round trip and one plan, and still atomic: the outcomes and the claim commit together or not
at all. Both parts read the same snapshot, which changes nothing here: outcomes touch the
worker's running rows, the claim only queued ones, and a job an outcome puts back in the
queue is claimed by the next pass, as before.

The statement is :mod:`jobs.queue.outcomes`' CTEs and :mod:`jobs.queue.claim`'s, composed;
their semantics (fencing, busy rows skipped, rows locked only as the claim's LIMIT pulls them)
are theirs. A pass with nothing to write is the claim alone, one with nothing to claim the
outcome write alone. The composed statement's result is the claimed rows, then one row that
carries the claim tokens of the outcomes written, of those whose rows another session held
locked, and of those written as cancelled because an operator had asked (with the error
detail written).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import timedelta

from django.db import DEFAULT_DB_ALIAS, transaction

from jobs.queue import _db, bound, flow, flow_claim, rollup
from jobs.queue.bound import RunRows
from jobs.queue.claim import (
    TIERED_FORM,
    claim,
    claim_parts,
    claim_update,
    claimed_jobs,
    plain_claim_ctes,
    run_claim,
    tiered_claim_ctes,
)
from jobs.queue.flow import FlowLimits
from jobs.queue.outcomes import (
    PASS_OUTCOME_CTES,
    ROLLUP_CTE,
    outcome_params,
    outcome_report,
    record,
)
from jobs.queue.types import (
    ClaimedJob,
    ClaimRequest,
    Outcome,
    OutcomeReport,
    Scope,
    pick_scope_sql,
)

# The claimed rows' columns (see the claim's RETURNING list), padded for the report row.
_CLAIMED_COLUMNS = 13

_REPORT_ROW = (
    "SELECT "
    + ", ".join(["NULL"] * _CLAIMED_COLUMNS)
    + ", (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy)"
    + ", (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL)"
    + ", (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL)"
    + ", (SELECT bool_or(settles) FROM written)"
)


# The worker's pass for job types without flow controls, as a PL/pgSQL function: planned
# inline, the statement cost PostgreSQL more to plan than to run (1.7 ms of a 49-job pass in
# a drain), and the control loop waits for it; in a function each connection keeps a generic
# plan, behind a transaction pooler too (nothing is prepared by the protocol). Its arguments
# are the statement's parameters, in this order and of these types.
_OUTCOME_ARGUMENTS = {
    "ids": "bigint[]",
    "tokens": "uuid[]",
    "states": "text[]",
    "codes": "text[]",
    "details": "text[]",
    "delays": "float8[]",
    "ats": "timestamptz[]",
    "deltas": "integer[]",
    "results": "jsonb[]",
    "reports": "jsonb[]",
}
_CLAIM_ARGUMENTS = {
    "total": "integer",
    "lease": "float8",
    "worker": "text",
    "pick_tenant": "text",
    "pick_component": "text",
}
_PASS_ARGUMENTS = {
    **_OUTCOME_ARGUMENTS,
    "names": "text[]",
    "limits": "integer[]",
    "caps": "integer[]",
    **_CLAIM_ARGUMENTS,
}
# The pass for names that are all fair with no limit (jobs.queue.claim.TIERED_FORM), as
# jobs_worker_fair_pass_v3: the same outcome write, the fair claim; its arguments are the flow
# claim's (jobs.queue.flow_claim.WANTED), most of them unused by this form but kept so the claim's
# text is the flow claim's own.
_FAIR_PASS_ARGUMENTS = {
    **_OUTCOME_ARGUMENTS,
    "names": "text[]",
    "limits": "integer[]",
    "caps": "integer[]",
    "gcaps": "integer[]",
    "tcaps": "integer[]",
    "rates": "float8[]",
    "bursts": "float8[]",
    "trates": "float8[]",
    "tbursts": "float8[]",
    "gated": "boolean[]",
    "ordered": "boolean[]",
    "afters": "text[]",
    "lshares": "float8[]",
    **_CLAIM_ARGUMENTS,
}
# What it returns: the claimed rows (the claim's RETURNING list), then the report row.
_PASS_COLUMNS = (
    ("id", "bigint"),
    ("job_id", "text"),
    ("name", "text"),
    ("payload", "jsonb"),
    ("tenant", "text"),
    ("queue", "text"),
    ("priority", "integer"),
    ("attempts", "integer"),
    ("max_attempts", "integer"),
    ("claim_token", "uuid"),
    ("latency", "float8"),
    ("ord", "bigint"),
    ("due", "float8"),
    ("written", "uuid[]"),
    ("busy", "uuid[]"),
    ("stopped", "uuid[]"),
    ("details", "text[]"),
    ("settle", "boolean"),
)


def _call(function: str, arguments: dict[str, str], first: str = "") -> str:
    """The statement that calls ``function`` with the parameters named as its arguments."""
    return (
        f"SELECT * FROM {function}({first}"
        + ", ".join(
            f"%({name})b::{kind}" if kind.endswith("[]") else f"%({name})s::{kind}"
            for name, kind in arguments.items()
        )
        + ")"
    )


# The functions' names carry a version: a change of their arguments or columns is a new
# function, and workers of the previous release keep calling theirs during a rolling deploy.
PASS_FUNCTION = "jobs_worker_pass_v3"
FAIR_PASS_FUNCTION = "jobs_worker_fair_pass_v3"
_PASS_CALL = _call(PASS_FUNCTION, _PASS_ARGUMENTS, "%(walk)s, ")
_FAIR_PASS_CALL = _call(FAIR_PASS_FUNCTION, _FAIR_PASS_ARGUMENTS)


def _argument(parameter: str) -> str:
    """The function's argument for a statement parameter (the scope's as
    :func:`~jobs.queue.types.pick_scope_sql` names them)."""
    return "p_" + parameter.removeprefix("pick_")


def _pass_query(claim_ctes: str, after: str = "") -> str:
    """The pass's statement with these claim CTEs (and ``after`` the claim's UPDATE), its
    parameters as the function's arguments."""
    claimed = ", ".join(f"c_{name}" for name, _ in _PASS_COLUMNS[:_CLAIMED_COLUMNS])
    casts = ", ".join(f"c_{name}::{kind}" for name, kind in _PASS_COLUMNS[:_CLAIMED_COLUMNS])
    sql = (
        f"WITH{PASS_OUTCOME_CTES[False]},"
        f"{claim_ctes}, "
        f"claimed({claimed}) AS ({claim_update()}){after}\n"
        f"SELECT {casts}, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean"
        " FROM claimed\n"
        f"UNION ALL\n{_REPORT_ROW}"
    )
    sql = re.sub(r"%\((\w+)\)[sb]", lambda m: _argument(m[1]), sql)
    if "%(" in sql:
        raise AssertionError("the pass function has a parameter it does not take")
    return "\n".join("        " + line if line else "" for line in sql.strip().splitlines())


def pass_function() -> str:
    """``CREATE OR REPLACE FUNCTION jobs_worker_pass_v3``: :func:`record_and_claim`'s statement
    for names without flow controls, as a function whose plan each connection keeps.

    Rendered into jobs/queue/sql/functions/, whose file the migrations install: a change to
    the SQL it is built from needs a migration that installs it again. ``p_walk`` picks the
    claim's priority walk (servers before PostgreSQL 18) or its single ordered scan; each is
    planned only where it runs. The function reads in a snapshot of its own, as the statement in
    autocommit did (the worker's passes are not inside a transaction).
    """
    scope = pick_scope_sql("j")
    return _function(
        PASS_FUNCTION,
        {"walk": "boolean", **_PASS_ARGUMENTS},
        "    IF p_walk THEN\n"
        "        RETURN QUERY\n"
        f"{_pass_query(plain_claim_ctes(walk=True, scope_sql=scope))};\n"
        "    ELSE\n"
        "        RETURN QUERY\n"
        f"{_pass_query(plain_claim_ctes(walk=False, scope_sql=scope))};\n"
        "    END IF;\n",
    )


def fair_pass_function() -> str:
    """``CREATE OR REPLACE FUNCTION jobs_worker_fair_pass_v3``: the pass for names that are all
    fair with no limit (:data:`~jobs.queue.claim.TIERED_FORM`), with a kept plan as
    :func:`pass_function`'s. Planned inline every pass, it cost the fair drain about 26 µs of
    PostgreSQL CPU a job more than the plain one (bench/fairness.py). Rendered and installed
    as :func:`pass_function` is.
    """
    # The claimed rows' columns are named c_<column> here (the function's own are r_<column>).
    after = flow_claim.after_claim(TIERED_FORM, {c: f"c_{c}" for c in flow_claim.CLAIMED_COLUMNS})
    return _function(
        FAIR_PASS_FUNCTION,
        _FAIR_PASS_ARGUMENTS,
        f"    RETURN QUERY\n{_pass_query(tiered_claim_ctes(), after)};\n",
    )


def _function(name: str, arguments: dict[str, str], body: str) -> str:
    listed = ",\n".join(f"    {_argument(a)} {kind}" for a, kind in arguments.items())
    columns = ", ".join(f"r_{column} {kind}" for column, kind in _PASS_COLUMNS)
    return (
        f"CREATE OR REPLACE FUNCTION {name}(\n{listed}\n"
        f") RETURNS TABLE ({columns})\n"
        "LANGUAGE plpgsql VOLATILE\n"
        # A custom plan's cost always reads below the generic one's, so left to itself
        # PostgreSQL would plan every call anew.
        "SET plan_cache_mode = force_generic_plan AS $$\n"
        "BEGIN\n"
        f"{body}"
        "END\n"
        "$$;\n"
    )


def inline_pass(ctes: str, update: str, post: str, *, count: bool) -> str:
    """The pass as one statement planned where it is sent: the outcome write's CTEs (with the
    rollup's when it ``count``s), then the claim of :func:`~jobs.queue.claim.claim_parts`'
    parts, for the passes the functions do not hold (flow controls other than fair order,
    or counted)."""
    counted = (f", {ROLLUP_CTE}", f" WHERE {rollup.reads()}") if count else ("", "")
    return (
        f"WITH {PASS_OUTCOME_CTES[count]}{counted[0]},{ctes}, claimed AS ({update}){post}\n"
        "SELECT *, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[], NULL::boolean"
        " FROM claimed\n"
        f"UNION ALL\n{_REPORT_ROW}{counted[1]}"
    )


def record_and_claim(
    outcomes: Sequence[Outcome],
    requests: Sequence[ClaimRequest],
    *,
    scope: Scope,
    limit: int | None = None,
    lease: timedelta | None = None,
    worker: str = "",
    count: bool = True,
    limits: Mapping[str, FlowLimits] | None = None,
    after: Mapping[str, str] | None = None,
    runs: RunRows | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[OutcomeReport, list[ClaimedJob]]:
    """Write ``outcomes`` and claim as :func:`~jobs.queue.claim` would, in one statement.

    Outside a transaction the statement is its own (autocommit); inside one it joins it. The
    report and the claimed jobs are what :func:`~jobs.queue.record` and
    :func:`~jobs.queue.claim` would return; ``count`` and ``runs`` are
    :func:`~jobs.queue.record`'s.

    Outcomes that drive bound run rows (``runs``) move those rows in the same transaction
    (:mod:`jobs.queue.bound`): such a pass is the outcome write, the rows' updates and the
    claim, three statements in one transaction.
    """
    if bound.involved(outcomes, runs):
        with transaction.atomic(using=using):
            report = record(outcomes, count=count, wait=False, runs=runs, using=using)
            return report, claim(
                requests,
                scope=scope,
                limit=limit,
                lease=lease,
                worker=worker,
                limits=limits,
                after=after,
                using=using,
            )
    parts = claim_parts(
        requests,
        scope=scope,
        limit=limit,
        lease=lease,
        worker=worker,
        using=using,
        limits=limits,
        after=after,
        releasing=bool(outcomes),
    )
    if parts is None:
        return record(outcomes, count=count, wait=False, using=using), []
    ctes, update, params, post = parts
    # The function holds the plain claim only. A name with flow controls needs the flow
    # claim, even one (fair order alone) with nothing to add after the UPDATE.
    form = flow.form([r for r in requests if r.limit > 0], limits)
    kept_plan = not count and (form is None or form == TIERED_FORM)
    if not outcomes and not kept_plan:  # a claim alone needs none of the report's CTEs
        return OutcomeReport((), ()), run_claim(parts, using)
    params = {**outcome_params(outcomes, using), **params}
    if kept_plan and form is None:  # the worker's pass for names without flow controls
        sql = _PASS_CALL
        params.update(scope.pick_params(), walk=_db.server_version(using) < 180000)
    elif kept_plan:  # every name fair with no limit: the fair pass
        sql = _FAIR_PASS_CALL
    else:
        sql = inline_pass(ctes, update, post, count=count)
    with _db.bound_cursor(using) as cur:
        cur.execute(sql, params)
        rows = cur.fetchall()
    # Claimed rows always have an id; the report row has none.
    [report_row] = [row for row in rows if row[0] is None]
    written, busy, stopped, details = (value or [] for value in report_row[-5:-1])
    report = outcome_report(
        outcomes,
        applied=set(written),
        busy=set(busy),
        stopped=dict(zip(stopped, details, strict=True)),
        settle=bool(report_row[-1]),
    )
    claimed = [row[:_CLAIMED_COLUMNS] for row in rows if row[0] is not None]
    return report, claimed_jobs(claimed)
