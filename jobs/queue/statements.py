"""The queue's statements and database functions in full, as the files under ``sql/`` hold them.

The queue sends statements assembled from parts: one claim serves every scope, server version
and set of flow controls, and the worker's pass is the outcome write and the claim in one. So
that a reader finds each finished statement in one place, this module renders them into
``jobs/queue/sql/``:

- ``claim.sql``, ``pass.sql``, ``outcomes.sql``: the claim's forms, the worker's pass and the
  outcome write, each named (``-- name: …``), as the code sends them;
- ``functions/<name>.sql``: each PL/pgSQL function (and the trigger that calls it) as the
  migrations install it. Those Python builds (the passes, the fair pick, the one-row
  enqueue) are rendered here; the others are written by hand, and their file is the source.

The rendered files are never edited by hand: change the code, then run::

    scripts/render-sql          # rewrite the rendered files (it calls :func:`main`)
    scripts/render-sql --check  # exit 1, naming them, when one differs

A test (tests/unit/test_statements.py) fails when a file and the code differ. A change to a
function's file needs a migration that installs it again (jobs/migrations/_functions.py).

The code keeps assembling the statements rather than reading them from these files: their
text depends on the worker's scope, the server's version and the flow controls of the names
claimed (hundreds of combinations), which the files show as named examples.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from jobs.queue import flow, flow_claim
from jobs.queue.claim import _claim_ctes, claim_sql, claim_update, fair_pick_function
from jobs.queue.cycle import (
    _FAIR_PASS_CALL,
    _PASS_CALL,
    fair_pass_function,
    inline_pass,
    pass_function,
)
from jobs.queue.enqueue_one import enqueue_function
from jobs.queue.outcomes import _RECORD, _RECORD_SKIPPING, outcome_params
from jobs.queue.types import AllTenantsExcept, Scope

#: Where the files are.
FOLDER = Path(__file__).with_name("sql")

# The worker's scope in the rendered statements: a base worker's (every tenant without an
# override for its component).
_SCOPE: Scope = AllTenantsExcept("worker")

_HEADER = (
    "-- Rendered from {source} by scripts/render-sql:\n"
    "-- edit the code, not this file, then run it (a test fails while the two differ).\n"
)


def _header(*builders: Callable[..., object]) -> str:
    """The first lines of a rendered file: the modules of the functions that build it."""
    modules = dict.fromkeys(b.__module__.replace(".", "/") + ".py" for b in builders)
    return _HEADER.format(source=" and ".join(modules))


def _form(**parts: bool) -> flow.FlowForm:
    """A flow claim's form with ``parts`` set and the others off."""
    off = {
        "gated": False,
        "plain": False,
        "tiered": False,
        "capped": False,
        "tenant_rated": False,
        "reserved": False,
    }
    return flow.FlowForm(**{**off, **parts})


# The flow claim's forms shown, each with what it is for.
_FLOW_FORMS: dict[str, tuple[flow.FlowForm, str]] = {
    "claim_gated": (
        _form(gated=True, plain=True),
        "Names with a fleet-wide limit (global_concurrency, rate_limit): each takes its gate\n"
        "row, its room is what its limit and bucket leave, and the claim bumps the gate.",
    ),
    "claim_tenant_limited": (
        _form(gated=True, capped=True, tenant_rated=True),
        "Names with tenant limits (tenant_concurrency, tenant_rate_limit): read tenant by\n"
        "tenant from the worker's cursor, each tenant's room within its limit and bucket,\n"
        "shared max-min fair by weight; the tenants' buckets are written after the claim.",
    ),
    "claim_fair": (
        _form(tiered=True),
        "Fair names without tenant limits: their rows and the tenants' accounts come from\n"
        "jobs_fair_pick_v2, and the accounts are written after the claim. (The worker's pass\n"
        "of such names is jobs_worker_fair_pass_v3, which holds this claim.)",
    ),
    "claim_lower_share": (
        _form(plain=True, reserved=True),
        "Names with lower_priority_share: the share of the claim kept for the due jobs\n"
        "below the top class first, then the plain order past them.",
    ),
}


def _named(name: str, about: str, sql: str) -> str:
    """One statement of a file of named statements: its name, what it is, its text (as sent,
    but for the spaces at the ends of its lines)."""
    comment = "".join(f"-- {line}".rstrip() + "\n" for line in about.splitlines())
    text = "\n".join(line.rstrip() for line in sql.strip().splitlines())
    return f"\n-- name: {name}\n{comment}{text}\n;\n"


def claim_file() -> str:
    """``claim.sql``: the claim's forms, within a base worker's scope."""
    plain = (
        "Names without flow controls, on PostgreSQL 18: for each name in the order asked, its\n"
        "due rows in one ordered scan of the claim index, locked as the outer LIMIT pulls\n"
        "them, then marked running with a fresh claim token and lease."
    )
    walk = (
        "The same before PostgreSQL 18, which cannot skip through an index: the due rows\n"
        "of each priority that has queued rows, highest first, one hop down the index each."
    )
    parts = [
        _named("claim", plain, claim_sql(_SCOPE, walk=False)[0]),
        _named("claim_walk", walk, claim_sql(_SCOPE, walk=True)[0]),
    ]
    for name, (form, about) in _FLOW_FORMS.items():
        parts.append(_named(name, about, claim_sql(_SCOPE, walk=False, flows=form)[0]))
    return _header(claim_sql, flow_claim.after_claim) + "".join(parts)


def pass_file() -> str:
    """``pass.sql``: the worker's pass, as the calls of its functions and as one statement."""
    gated = _form(gated=True, plain=True, releasing=True)
    ctes, _ = _claim_ctes(_SCOPE, False, "", gated)
    parts = [
        _named(
            "pass",
            "The worker's pass for names without flow controls: its outcomes written and the\n"
            "next jobs claimed in one call (functions/jobs_worker_pass_v3.sql), whose plan\n"
            "each connection keeps. p_walk picks the claim's form for the server.",
            _PASS_CALL,
        ),
        _named(
            "fair_pass",
            "The same for names all fair with no limit (functions/jobs_worker_fair_pass_v3.sql).",
            _FAIR_PASS_CALL,
        ),
        _named(
            "pass_inline",
            "The pass for other flow controls (here a fleet-wide limit) as one statement: the\n"
            "outcome write, the claim (whose rooms count the jobs it ends as free), the gates'\n"
            "update; then the claimed rows and one report row. Counted passes (outside the\n"
            "worker) add the rollup's CTE.",
            inline_pass(ctes, claim_update(), flow_claim.after_claim(gated), count=False),
        ),
    ]
    return _header(inline_pass) + "".join(parts)


def outcomes_file() -> str:
    """``outcomes.sql``: the outcome write, fenced by the claim token."""
    parts = [
        _named(
            "record",
            "Outcomes written, fenced by their claim tokens, and counted in the console's\n"
            "rollup; an ending batch member waits for its batch's row (locked first).",
            _RECORD[True],
        ),
        _named(
            "record_uncounted",
            "The same for a caller that counts its own attempts (the worker).",
            _RECORD[False],
        ),
        _named(
            "record_skipping",
            "Never waiting: rows (and batch rows) another session holds are reported busy.",
            _RECORD_SKIPPING[True],
        ),
        _named(
            "record_skipping_uncounted",
            "The worker's outcome write when its pass claims nothing.",
            _RECORD_SKIPPING[False],
        ),
    ]
    return _header(outcome_params) + "".join(parts)


def _function(build: Callable[[], str]) -> Callable[[], str]:
    return lambda: _header(build) + build()


#: Each rendered file (its path under :data:`FOLDER`) and what renders it.
RENDERED: dict[str, Callable[[], str]] = {
    "claim.sql": claim_file,
    "pass.sql": pass_file,
    "outcomes.sql": outcomes_file,
    "functions/jobs_worker_pass_v3.sql": _function(pass_function),
    "functions/jobs_worker_fair_pass_v3.sql": _function(fair_pass_function),
    "functions/jobs_fair_pick_v2.sql": _function(fair_pick_function),
    "functions/jobs_enqueue_job.sql": _function(enqueue_function),
}


def stale() -> list[str]:
    """The rendered files whose text is not what the code renders now."""
    return [
        path
        for path, render in RENDERED.items()
        if not (FOLDER / path).is_file() or (FOLDER / path).read_text() != render()
    ]


def write() -> list[str]:
    """Rewrite the rendered files that differ; returns their paths."""
    changed = stale()
    for path in changed:
        (FOLDER / path).parent.mkdir(parents=True, exist_ok=True)
        (FOLDER / path).write_text(RENDERED[path]())
    return changed


def main(argv: list[str]) -> int:
    """The command line: ``--check`` reports, otherwise rewrites, the files that differ."""
    changed = stale() if "--check" in argv else write()
    for path in changed:
        print(f"{'differs' if '--check' in argv else 'rendered'}: jobs/queue/sql/{path}")
    return 1 if changed and "--check" in argv else 0
