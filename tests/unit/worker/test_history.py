"""The worker's history tally: what it counts for a pass's outcomes, whatever the report says.

``History.count`` skips looking up each claim token when the report has nothing fenced, busy
or stopped; for any report it must count exactly what looking each one up counts.
"""

from __future__ import annotations

from types import SimpleNamespace
from uuid import uuid4

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.queue import rollup
from jobs.queue.outcomes import outcome_report
from jobs.queue.types import ClaimedJob, Outcome
from jobs.worker import history as history_module
from jobs.worker.history import History

KINDS = ("succeeded", "failed", "retry", "released", "cancelled")
FATES = ("applied", "busy", "fenced", "stopped")


def _outcome(kind: str, job: ClaimedJob) -> Outcome:
    if kind == "succeeded":
        return Outcome.succeeded(job)
    if kind == "failed":
        return Outcome.failed(job, code="handler_error", detail="boom")
    if kind == "retry":
        return Outcome.retry(job, code="handler_error", detail="again", delay=1.0)
    if kind == "released":
        return Outcome.released(job)
    return Outcome.cancelled(job)


def _looked_up(outcomes, report, now: float) -> dict:
    """What counting each outcome by its token's lookup gives (the reference)."""
    tally = rollup.Tally()
    for running, outcome in outcomes:
        if not report.was_applied(outcome):
            continue
        item = rollup.ended(
            running.job.name,
            outcome,
            report.as_written(outcome),
            ran=now - running.claimed_at,
            waited=running.job.latency,
        )
        if item is not None:
            tally.add(item)
    return tally.groups


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from(FATES), st.sampled_from("ab")),
        max_size=12,
    ),
    st.floats(0, 100),
)
def test_a_pass_is_counted_as_looking_up_every_token_would(jobs, waited):
    now = 1000.0
    outcomes = []
    applied, busy, stopped = set(), set(), {}
    for number, (kind, fate, name) in enumerate(jobs, start=1):
        job = ClaimedJob(
            id=number,
            job_id=f"j{number}",
            name=f"test.{name}.v1",
            payload={},
            tenant="t",
            queue="q",
            priority=0,
            attempts=1,
            max_attempts=3,
            claim_token=uuid4(),
            latency=waited,
        )
        outcome = _outcome(kind, job)
        outcomes.append((SimpleNamespace(job=job, claimed_at=now - number / 10), outcome))
        if fate in ("applied", "stopped"):
            applied.add(job.claim_token)
        if fate == "stopped":
            stopped[job.claim_token] = "cancelled by an operator"
        if fate == "busy":
            busy.add(job.claim_token)
    report = outcome_report([o for _, o in outcomes], applied=applied, busy=busy, stopped=stopped)

    counted = History()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(history_module.time, "monotonic", lambda: now)
        counted.count(outcomes, report)

    assert counted._tally.groups == _looked_up(outcomes, report, now)
