"""The claim. (Lease renewal and the next attempt are :mod:`jobs.queue.renewal`.)

Over 400 lines: the claim's statement fragments and the forms that assemble them are read
together.

A claim is one statement: for each requested name, in the order given (the worker rotates it),
take up to that name's limit of due queued rows with ``FOR UPDATE SKIP LOCKED``, stopping at
the overall limit, and mark them running with a fresh claim token and a lease timed by
PostgreSQL's clock. Rows are locked only as the outer LIMIT pulls them, so nothing is locked
and then dropped. The claim counts as an attempt. Nothing is prefetched: the caller asks for
exactly its free capacity.

Within a name, rows come in the claim index's order (priority DESC, run_after, id), reading
only the due range of each priority. PostgreSQL 18 does that in one ordered scan: it skips
from one priority to the next through the index. Earlier servers cannot; there a single scan
would step over every future row of a higher priority before reaching a due row of a lower
one (a million delayed high-priority jobs: 75 ms a claim on PostgreSQL 15), so the statement
walks the priorities that have queued rows instead, highest first, one hop down the index
each. On 18 the single scan plans faster and, after a large drain, crosses the dead index
entries once where the walk crosses them twice.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS

from jobs.core.conf import jobs_settings
from jobs.queue import (
    _db,
    flow,
    flow_claim,
    flow_fair,
    pauses,
)
from jobs.queue._arrays import array
from jobs.queue.types import (
    AllTenants,
    ClaimedJob,
    ClaimRequest,
    Scope,
    pick_scope_sql,
)

# The claim's CTEs: what is paused, what each name asks for (paused names left out), and the
# rows picked for it (locked as the outer LIMIT pulls them). ``{due}`` is one of the two
# forms below.
_CLAIM_CTES = (
    pauses.PAUSED_CTE
    + """,
wanted AS (
    SELECT * FROM unnest(%(names)b::text[], %(limits)b::int[], %(caps)b::int[])
        WITH ORDINALITY AS w(name, lim, cap, ord)
    WHERE """
    + pauses.PAUSED_NAMES
    + """
),
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM wanted w
    CROSS JOIN LATERAL ({due}
    ) c
    LIMIT %(total)s
)
"""
)

_CLAIM_UPDATE = """
UPDATE jobs_job j
SET state = 'running',
    attempts = j.attempts + 1,
    claim_token = gen_random_uuid(),
    lease_expires_at = statement_timestamp() + make_interval(secs => %(lease)s),
    heartbeat_at = statement_timestamp(),
    started_at = statement_timestamp(),
    claimed_by = %(worker)s
FROM picked
WHERE j.id = picked.id
RETURNING j.id, j.job_id, j.name, j.payload, j.tenant, j.queue, j.priority, j.attempts,
          LEAST(j.max_attempts, COALESCE(picked.cap, j.max_attempts)), j.claim_token,
          GREATEST(0, EXTRACT(EPOCH FROM j.started_at - j.run_after))::float8,
          picked.ord, EXTRACT(EPOCH FROM j.run_after)::float8
"""

# The due rows of one name (of one priority in the walk), in claim order, locked as pulled.
_DUE_ROWS = """
SELECT j.id FROM jobs_job j
WHERE j.state = 'queued'
  AND j.name = w.name{priority}
  AND j.run_after <= statement_timestamp()
  AND j.attempts < LEAST(j.max_attempts, COALESCE(w.cap, j.max_attempts))
  AND {scope}
  AND {paused}
ORDER BY j.priority DESC, j.run_after, j.id
LIMIT w.lim
FOR UPDATE SKIP LOCKED
"""

# PostgreSQL 18 skips through the claim index by itself: one ordered scan of the due range.
_DUE_SCAN = _DUE_ROWS.replace("{priority}", "")

# Before 18: walk the priorities that have queued rows and read the due range of each.
_DUE_WALK = (
    """
-- The priorities this name has queued rows at, highest first: one hop down the claim index
-- each, evaluated only as far as the claim below asks.
WITH RECURSIVE """
    + flow_fair.LEVELS
    + """
SELECT due.id FROM levels l
CROSS JOIN LATERAL ("""
    + _DUE_ROWS.replace("{priority}", "\n  AND j.priority = l.priority")
    + """) due
LIMIT w.lim
"""
)


# With flow controls (jobs.queue.flow): the names' rooms (after their gates when any name
# has a shared limit), then for each name either the due rows as above or, for a
# tenant-ordered name, its tenants' shares. Parts no requested name needs are left out, so
# they are not planned.
_FLOW_PICKED = """,
picked AS (
    SELECT c.id, w.cap, w.ord
    FROM room w
    CROSS JOIN LATERAL ({branches}
    ) c
    WHERE w.lim > 0
    LIMIT %(total)s
)
"""
_PLAIN_BRANCH = """
        SELECT d.id FROM ({due}
        ) d WHERE NOT w.ordered"""
# A fair name without tenant limits: its rows come from the function, whose plans each
# connection keeps (planning the statement inline cost more than running it), with the
# accounts its tenants' starts go to (flow_fair.FAIR_ROWS), written after the claim.
_FAIR_PICK = """,
fair_pick AS MATERIALIZED (
    SELECT w.name, f.id, f.tenant, f.base, f.top
    FROM room w
    CROSS JOIN LATERAL jobs_fair_pick_v2(
        w.name, w.lim, w.cap, w.after, w.lshare,
        (SELECT queues FROM paused), (SELECT tenants FROM paused),
        %(pick_tenant)s::text, %(pick_component)s::text) AS f(id, tenant, base, top)
    WHERE w.lim > 0 AND w.ordered AND w.tcap IS NULL AND w.trate IS NULL
)"""
_TIERED_BRANCH = """
        SELECT fp.id FROM fair_pick fp WHERE fp.name = w.name AND fp.id IS NOT NULL"""
_CAPPED_BRANCH = """
        SELECT t.id FROM ({tenant_rows}
        ) t WHERE w.ordered AND (w.tcap IS NOT NULL OR w.trate IS NOT NULL)"""


_RESERVED_BRANCH = """
        (SELECT r.id FROM ({reserved}
        ) r WHERE NOT w.ordered
        LIMIT w.lim)"""


def _top_and_kept(due: str, scope_sql: str) -> str:
    """The CTEs of the top class (``top``) and of the places kept below it (``low``)."""
    top_level = flow_fair.TOP_LEVEL.replace("{scope}", scope_sql).replace(
        "{paused}", pauses.PAUSED_ROWS
    )
    return top_level + flow_fair.LOW.replace("{due}", flow_fair.below_top(due))


def _tiered_rows(due: str, scope_sql: str) -> str:
    """A fair name's rows within its highest class with due jobs, the places it keeps for
    the classes below first and the room its tenants leave filled from them, then its
    tenants' accounts to write (``w`` is its room row, the rows read within ``scope_sql``);
    :func:`fair_pick_function` makes it a function."""
    fill = flow_fair.FILL.replace(
        "{due}", flow_fair.below_top(flow_fair.narrowed(due, flow_fair.NOT_LOW))
    )
    return (
        flow_fair.FAIR_ROWS.replace("{scope}", scope_sql)
        .replace("{paused}", pauses.PAUSED_ROWS)
        .replace("{tenant_scope}", pick_scope_sql("c"))
        .replace("{account_scope}", pick_scope_sql("s"))
        .replace("{top}", _top_and_kept(due, scope_sql))
        .replace("{budget}", flow_fair.LOW_BUDGET)
        .replace("{level}", flow_fair.TOP_LEVEL_ROWS)
        .replace("{low_rows}", flow_fair.LOW_ROWS)
        .replace("{fill}", fill)
    )


# What the function takes for what a claim's room row (``w``) and ``paused`` CTE give.
_PICK_ARGUMENTS = {
    "w.name": "p_name",
    "w.lim": "p_lim",
    "w.cap": "p_cap",
    "w.after": "p_after",
    "w.lshare": "p_lshare",
    "(SELECT queues FROM paused)": "p_queues",
    "(SELECT tenants FROM paused)": "p_tenants",
}


def fair_pick_function() -> str:
    """``CREATE OR REPLACE FUNCTION jobs_fair_pick_v2``: :func:`_tiered_rows` as a PL/pgSQL
    function, so each connection plans it a few times and then keeps a generic plan.

    Rendered into jobs/queue/sql/functions/, whose file the migrations install: a change to
    the SQL it is built from needs a migration that installs it again. It reads the classes by
    the priority walk, which every supported server runs, and takes the worker's scope as
    arguments (:func:`~jobs.queue.types.pick_scope_sql`). It runs in a snapshot of its own
    (a VOLATILE function's): rows it locks that the claim's snapshot does not show are
    updated by the claim as any row changed since its snapshot is; rows enqueued since then
    stay queued.
    """
    due = _DUE_WALK.format(scope=pick_scope_sql("j"), paused=pauses.PAUSED_ROWS)
    rows = _tiered_rows(due, pick_scope_sql("j"))
    for column, argument in _PICK_ARGUMENTS.items():
        rows = rows.replace(column, argument)
    if re.search(r"\bw\.|\bpaused\b", rows):
        raise AssertionError("the fair pick refers to the claim's statement")
    body = "\n".join("    " + line if line else "" for line in rows.strip().splitlines())
    return (
        "CREATE OR REPLACE FUNCTION jobs_fair_pick_v2(\n"
        "    p_name text, p_lim integer, p_cap integer, p_after text, p_lshare float8,\n"
        "    p_queues text[], p_tenants text[], p_tenant text, p_component text\n"
        # The rows to claim (``r_id``), then the accounts to write (``r_id`` NULL).
        ") RETURNS TABLE (r_id bigint, r_tenant text, r_base float8, r_top integer)\n"
        "LANGUAGE plpgsql VOLATILE\n"
        # The cost of a custom plan is always estimated below the generic one's (a bound
        # LIMIT reads as few rows), so left to itself PostgreSQL plans it anew every call.
        "SET plan_cache_mode = force_generic_plan AS $$\n"
        "BEGIN\n"
        "    RETURN QUERY\n"
        f"{body};\n"
        "END\n"
        "$$;\n"
    )


def _flow_ctes(due: str, flows: flow.FlowForm, scope: Scope) -> str:
    scope_sql, _ = scope.sql("j")
    branches = []
    if flows.plain and flows.reserved:
        # The kept places first, then the plain order past them.
        reserved = (
            "\nWITH RECURSIVE "
            + _top_and_kept(due, scope_sql).rstrip().rstrip(",")
            + "\n"
            + flow_fair.LOW_ROWS
            + "SELECT p.id FROM ("
            + flow_fair.narrowed(due, flow_fair.NOT_LOW)
            + "\n) p"
        )
        branches.append(_RESERVED_BRANCH.replace("{reserved}", reserved))
    elif flows.plain:
        branches.append(_PLAIN_BRANCH.replace("{due}", due))
    if flows.tiered:
        branches.append(_TIERED_BRANCH)
    if flows.capped:
        rows = (
            flow_claim.tenant_rows(limited=True, releasing=flows.releasing)
            .replace("{scope}", scope_sql)
            .replace("{paused}", pauses.PAUSED_ROWS)
            .replace("{tenant_scope}", scope.sql("c")[0])
            .replace("{top}", "")
            .replace("{budget}", "w.lim")
            .replace("{level}", "")
            .replace("{low_rows}", "")
            .replace("{fill}", "")
        )
        branches.append(_CAPPED_BRANCH.replace("{tenant_rows}", rows))
    return (
        pauses.PAUSED_CTE
        + ","
        + flow_claim.WANTED.format(paused_names=pauses.PAUSED_NAMES)
        + ","
        + flow_claim.gate(flows)
        + (_FAIR_PICK if flows.tiered else "")
        + _FLOW_PICKED.replace("{branches}", "\n        UNION ALL".join(branches))
    )


#: The flow claim's form when every name asked for is fair with no fleet-wide or tenant limit:
#: their tenant part is :sql:`jobs_fair_pick_v2`, which takes the scope as arguments.
TIERED_FORM = flow.FlowForm(
    gated=False, plain=False, tiered=True, capped=False, tenant_rated=False, reserved=False
)


def tiered_claim_ctes() -> str:
    """The claim's CTEs for :data:`TIERED_FORM` (no scope of the rows themselves is read)."""
    return _flow_ctes("", TIERED_FORM, AllTenants())


def plain_claim_ctes(*, walk: bool, scope_sql: str) -> str:
    """The claim's CTEs for names without flow controls, the rows read within ``scope_sql``
    (for SQL that takes the scope as arguments: :func:`~jobs.queue.types.pick_scope_sql`)."""
    due = (_DUE_WALK if walk else _DUE_SCAN).format(scope=scope_sql, paused=pauses.PAUSED_ROWS)
    return _CLAIM_CTES.replace("{due}", due)


def claim_update() -> str:
    """The claim's UPDATE of the rows ``picked``, RETURNING what :func:`claimed_jobs` reads."""
    return _CLAIM_UPDATE


def claim_sql(
    scope: Scope,
    *,
    walk: bool | None = None,
    flows: flow.FlowForm | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[str, dict[str, Any]]:
    """The claim statement for a scope and the scope's parameters (also used for EXPLAIN,
    and for the named forms in jobs/queue/sql/claim.sql).

    ``walk`` picks the priority walk (default: on servers before PostgreSQL 18, which cannot
    skip through an index by themselves) or the single ordered scan; ``flows`` the flow
    claim's form (None: the claim of names without flow controls).
    """
    ctes, scope_params = _claim_ctes(scope, walk, using, flows)
    post = "" if flows is None else flow_claim.after_claim(flows)
    return claim_statement(ctes, _CLAIM_UPDATE, post), scope_params


def claim_statement(ctes: str, update: str, post: str) -> str:
    """The claim statement made of :func:`claim_parts`' parts."""
    if post:
        return f"WITH {ctes}, claimed AS ({update}){post}\nSELECT * FROM claimed"
    return "WITH " + ctes + update


def _claim_ctes(
    scope: Scope, walk: bool | None, using: str, flows: flow.FlowForm | None = None
) -> tuple[str, dict[str, Any]]:
    if walk is None:
        walk = _db.server_version(using) < 180000
    scope_sql, scope_params = scope.sql("j")
    due = (_DUE_WALK if walk else _DUE_SCAN).format(scope=scope_sql, paused=pauses.PAUSED_ROWS)
    if flows is None:
        return _CLAIM_CTES.replace("{due}", due), scope_params

    return _flow_ctes(due, flows, scope), scope_params


def claim_parts(
    requests: Sequence[ClaimRequest],
    *,
    scope: Scope,
    limit: int | None,
    lease: timedelta | None,
    worker: str,
    using: str,
    limits: Mapping[str, flow.FlowLimits] | None = None,
    after: Mapping[str, str] | None = None,
    releasing: bool = False,
) -> tuple[str, str, dict[str, Any], str] | None:
    """The claim as its CTEs, its UPDATE, their parameters and the CTEs that must follow the
    UPDATE (named ``claimed``; empty without flow controls); None when nothing is asked.

    For statements that claim along with other work (:mod:`jobs.queue.cycle`). ``limits``
    are the flow controls of the names that have them; ``after`` each tenant-ordered name's
    cursor (:func:`jobs.queue.flow.next_cursor`). ``releasing``: the statement also writes
    outcomes in a CTE named ``written`` (their jobs' places are free at its commit).
    """
    requests = [r for r in requests if r.limit > 0]
    total = (
        sum(r.limit for r in requests)
        if limit is None
        else min(limit, sum(r.limit for r in requests))
    )
    if total <= 0:
        return None
    flows = flow.form(requests, limits)
    if flows is not None:
        requests = flow.merged(requests)  # one request a name: a limit is per name
        if releasing:
            flows = dataclasses.replace(flows, releasing=True)
    ctes, scope_params = _claim_ctes(scope, None, using, flows)
    params = {
        "names": array("text", [r.name for r in requests]),
        "limits": array("integer", [r.limit for r in requests]),
        "caps": array("integer", [r.max_attempts for r in requests]),
        "total": total,
        "lease": _db.seconds(lease or jobs_settings.LEASE),
        "worker": worker,
        **scope_params,
    }
    if flows is None:
        return ctes, _CLAIM_UPDATE, params, ""
    params.update(flow.request_params(requests, limits or {}, after or {}))
    if flows.tiered:
        params.update(scope.pick_params())
    return ctes, _CLAIM_UPDATE, params, flow_claim.after_claim(flows)


def claimed_jobs(rows: Sequence[Sequence[Any]]) -> list[ClaimedJob]:
    """Rows of the claim's RETURNING list as jobs, in claim order.

    UPDATE … RETURNING keeps no order: the rows carry their request's position and their
    due time (epoch seconds, a cheaper sort key to read than a timestamp) to sort them back.
    """
    ordered = sorted(rows, key=lambda row: (row[11], -row[6], row[12], row[0]))
    return [
        ClaimedJob(
            id=row[0],
            job_id=row[1],
            name=row[2],
            payload=_db.load_json_or_text(row[3]),
            tenant=row[4],
            queue=row[5],
            priority=row[6],
            attempts=row[7],
            max_attempts=row[8],
            claim_token=row[9],
            latency=row[10],
        )
        for row in ordered
    ]


def claim(
    requests: Sequence[ClaimRequest],
    *,
    scope: Scope,
    limit: int | None = None,
    lease: timedelta | None = None,
    worker: str = "",
    limits: Mapping[str, flow.FlowLimits] | None = None,
    after: Mapping[str, str] | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` due jobs (default: the sum of the requests' limits).

    Within a name, jobs come highest priority first, then earliest due, then oldest. A
    returned job's ``max_attempts`` is the lower of its own limit and the request's. Names
    in ``limits`` are claimed within their flow controls (:mod:`jobs.queue.flow`).
    """
    parts = claim_parts(
        requests,
        scope=scope,
        limit=limit,
        lease=lease,
        worker=worker,
        using=using,
        limits=limits,
        after=after,
    )
    return run_claim(parts, using) if parts is not None else []


def run_claim(parts: tuple[str, str, dict[str, Any], str], using: str) -> list[ClaimedJob]:
    """Run the claim statement :func:`claim_parts` built."""
    ctes, update, params, post = parts
    with _db.bound_cursor(using) as cur:
        cur.execute(claim_statement(ctes, update, post), params)
        return claimed_jobs(cur.fetchall())
