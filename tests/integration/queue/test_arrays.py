"""Array parameters encoded by struct (jobs.queue._arrays) arrive as psycopg's lists do.

The worker's pass and the claim send their arrays pre-encoded; these tests hold the encoding
to what PostgreSQL reads from psycopg's own dumping of the same list, for any values.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from uuid import UUID

import pytest
from django.db import DataError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.queue import _db
from jobs.queue._arrays import array

pytestmark = pytest.mark.django_db

_TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=8)
_ZONES = st.sampled_from(
    [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]
)
_DATETIMES = st.builds(
    lambda moment, zone: moment.replace(tzinfo=UTC).astimezone(zone),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),
    _ZONES,
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=6,
)
# Each kind's element values.
KINDS = {
    "bigint": st.integers(-(2**63), 2**63 - 1),
    "integer": st.integers(-(2**31), 2**31 - 1),
    "float8": st.floats(width=64),
    "boolean": st.booleans(),
    "text": _TEXT | _TEXT.map(lambda short: short * 20),  # short ones are cached, long not
    "uuid": st.uuids().map(lambda u: UUID(int=u.int)),
    "timestamptz": _DATETIMES,
    "jsonb": _JSON.map(json.dumps),
}


def _as_text(sql_type: str, param) -> str:
    """How PostgreSQL reads ``param`` as an array of ``sql_type``, written back as text."""
    with _db.bound_cursor(None) as cur:
        cur.execute(f"SELECT (%(a)b::{sql_type}[])::text", {"a": param})
        return cur.fetchone()[0]


def _plain(values: list) -> object:
    """The list as psycopg takes it; one with no value at all (psycopg cannot tell its
    element type then) as the array's text, which the statement casts."""
    if all(value is None for value in values):
        return "{" + ",".join("NULL" for _ in values) + "}"
    return values


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), kind=st.sampled_from(sorted(KINDS)))
def test_an_encoded_array_reads_as_psycopg_s_list_does(data, kind):
    """Any values of each kind, NULLs among them, empty and all-NULL arrays included (JSON
    text goes to jsonb[] by a text[] cast the plain way)."""
    values = data.draw(st.lists(st.none() | KINDS[kind], max_size=6))
    assert _as_text(kind, array(kind, values)) == _as_text(kind, _plain(values))


def test_the_encoded_arrays_are_sent_in_one_piece_each():
    """A pass's statement with encoded arrays: psycopg dumps each as the bytes made here."""
    ids = array("bigint", [1, 2, None])
    assert _as_text("bigint", ids) == "{1,2,NULL}"
    assert _as_text("text", array("text", [])) == "{}"


def test_values_the_encoder_cannot_take_are_left_to_psycopg_and_postgresql():
    """A token given as text, a number past the type's range: psycopg dumps the list, and
    PostgreSQL casts it or refuses it as it does any list psycopg sends."""
    token = "6f1c1f0e-8a6e-4c55-9a39-0d2d7f0b5c11"
    assert array("uuid", [token]) == [token]
    assert _as_text("uuid", array("uuid", [token])) == "{" + token + "}"
    assert array("integer", [2**40]) == [2**40]
    with pytest.raises(DataError):
        _as_text("integer", array("integer", [2**40]))
