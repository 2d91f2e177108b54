"""Values and settings that need no database."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from jobs.core.conf import DEFAULTS, as_timedelta, jobs_settings
from jobs.queue import ClaimedJob, Outcome


def claimed(attempts=1, max_attempts=3):
    return ClaimedJob(
        1,
        "j",
        "a.v1",
        {},
        "default",
        "default",
        0,
        attempts,
        max_attempts,
        uuid.uuid4(),
        0.0,
    )


def test_final_attempt_flag():
    assert not claimed(attempts=2, max_attempts=3).final_attempt
    assert claimed(attempts=3, max_attempts=3).final_attempt


def test_outcome_constructors_carry_the_token():
    job = claimed()
    assert Outcome.succeeded(job, 5) == Outcome(
        job.id, job.claim_token, "succeeded", result_json="5"
    )
    retry = Outcome.retry(job, code="handler_error", delay=timedelta(seconds=2))
    assert (retry.state, retry.delay, retry.code) == ("queued", 2.0, "handler_error")
    assert Outcome.released(job).attempts_delta == -1
    assert Outcome.released(job).code is None  # keeps the job's last error


def test_settings_have_defaults_and_accept_seconds():
    assert timedelta(seconds=10) == jobs_settings.LEASE
    assert DEFAULTS["SUCCESS_WINDOW"] == jobs_settings.SUCCESS_WINDOW
    with override_settings(JOBS={"LEASE": 30, "DEFAULT_MAX_ATTEMPTS": 2}):
        assert timedelta(seconds=30) == jobs_settings.LEASE
        assert jobs_settings.DEFAULT_MAX_ATTEMPTS == 2
    assert timedelta(seconds=10) == jobs_settings.LEASE


def test_unknown_setting_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="unknown JOBS setting 'NOPE'"):
        _ = jobs_settings.NOPE


@pytest.mark.parametrize("bad", ["10", None, True])
def test_durations_must_be_numbers_or_timedeltas(bad):
    with pytest.raises(TypeError, match="expected a timedelta or a number of seconds"):
        as_timedelta(bad)


@given(
    outcomes=st.lists(st.tuples(st.integers(1, 50), st.integers(0, 7)), max_size=30),
    applied=st.sets(st.integers(0, 7)),
    busy=st.sets(st.integers(0, 7)),
)
def test_outcome_report_sorts_any_outcomes_as_the_token_sets_say(outcomes, applied, busy):
    """Each outcome is written, busy or fenced by its token, in the outcomes' order (a
    token in both sets counts as both), whatever the outcomes and sets."""
    from jobs.queue.outcomes import outcome_report

    tokens = [uuid.UUID(int=n) for n in range(8)]
    made = [Outcome(id_, tokens[t], "succeeded") for id_, t in outcomes]
    applied_tokens = {tokens[t] for t in applied}
    busy_tokens = {tokens[t] for t in busy}
    report = outcome_report(made, applied=applied_tokens, busy=busy_tokens)
    assert report.applied == tuple(o.id for o in made if o.token in applied_tokens)
    assert report.busy == tuple(o.id for o in made if o.token in busy_tokens)
    assert report.fenced == tuple(
        o.id for o in made if o.token not in applied_tokens and o.token not in busy_tokens
    )
