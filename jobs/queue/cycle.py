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

from collections.abc import Mapping, Sequence
from datetime import timedelta

from django.db import DEFAULT_DB_ALIAS

from jobs.queue import _db, rollup
from jobs.queue.claim import claim, claim_parts, claimed_jobs
from jobs.queue.flow import FlowLimits
from jobs.queue.outcomes import (
    OUTCOME_CTES,
    ROLLUP_CTE,
    outcome_params,
    outcome_report,
    record,
)
from jobs.queue.types import ClaimedJob, ClaimRequest, Outcome, OutcomeReport, Scope

# The claimed rows' columns (see the claim's RETURNING list), padded for the report row.
_CLAIMED_COLUMNS = 13

_REPORT_ROW = (
    "SELECT "
    + ", ".join(["NULL"] * _CLAIMED_COLUMNS)
    + ", (SELECT array_agg(token) FROM written), (SELECT array_agg(token) FROM busy)"
    + ", (SELECT array_agg(token) FROM written WHERE stopped IS NOT NULL)"
    + ", (SELECT array_agg(stopped) FROM written WHERE stopped IS NOT NULL)"
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
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[OutcomeReport, list[ClaimedJob]]:
    """Write ``outcomes`` and claim as :func:`~jobs.queue.claim` would, in one statement.

    Outside a transaction the statement is its own (autocommit); inside one it joins it. The
    report and the claimed jobs are what :func:`~jobs.queue.record` and
    :func:`~jobs.queue.claim` would return; ``count`` is :func:`~jobs.queue.record`'s.
    """
    if not outcomes:  # a claim-only pass (an idle worker's pickup): no outcome CTEs to plan
        jobs = claim(
            requests,
            scope=scope,
            limit=limit,
            lease=lease,
            worker=worker,
            using=using,
            limits=limits,
            after=after,
        )
        return OutcomeReport((), ()), jobs
    parts = claim_parts(
        requests,
        scope=scope,
        limit=limit,
        lease=lease,
        worker=worker,
        using=using,
        limits=limits,
        after=after,
        releasing=True,
    )
    if parts is None:
        return record(outcomes, count=count, using=using), []
    ctes, update, params, post = parts
    counted = (f", {ROLLUP_CTE}", f" WHERE {rollup.reads()}") if count else ("", "")
    sql = (
        f"WITH {OUTCOME_CTES[count]}{counted[0]},{ctes}, claimed AS ({update}){post}\n"
        "SELECT *, NULL::uuid[], NULL::uuid[], NULL::uuid[], NULL::text[] FROM claimed\n"
        f"UNION ALL\n{_REPORT_ROW}{counted[1]}"
    )
    with _db.bound_cursor(using) as cur:
        cur.execute(sql, {**outcome_params(outcomes, using), **params})
        rows = cur.fetchall()
    # Claimed rows always have an id; the report row has none.
    [report_row] = [row for row in rows if row[0] is None]
    written, busy, stopped, details = (value or [] for value in report_row[-4:])
    report = outcome_report(
        outcomes,
        applied=set(written),
        busy=set(busy),
        stopped=dict(zip(stopped, details, strict=True)),
    )
    claimed = [row[:_CLAIMED_COLUMNS] for row in rows if row[0] is not None]
    return report, claimed_jobs(claimed)
