"""Effect keys (jobs.api.effects.key_for): stable for a (row, step), distinct across them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from jobs.api.effects import STEP_MAX, key_for

ids = st.integers(min_value=1, max_value=2**63 - 1)
steps = st.text(min_size=1, max_size=STEP_MAX)
moments = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)
)


@given(ids, moments, steps)
def test_a_key_is_a_uuid_that_depends_only_on_row_created_at_and_step(row, created, step):
    key = key_for(row, created, step)
    assert key == key_for(row, created, step)
    assert len(key) <= 64 and str(uuid.UUID(key)) == key
    # The same moment in another zone (as a connection with another TIME_ZONE reads it).
    assert key_for(row, created.astimezone(timezone(timedelta(hours=-7))), step) == key


@given(st.tuples(ids, moments, steps), st.tuples(ids, moments, steps))
def test_different_rows_creation_times_or_steps_get_different_keys(one, other):
    if one != other:
        assert key_for(*one) != key_for(*other)


def test_the_key_of_a_known_row_never_changes():
    """Keys already sent to providers must stay valid across releases."""
    created = datetime(2026, 12, 2, 10, 0, 0, 123456, tzinfo=UTC)
    assert key_for(42, created, "charge") == "8a6393e3-0927-5cf7-b033-50a41162723e"
