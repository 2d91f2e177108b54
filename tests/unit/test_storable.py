"""Outcomes and enqueue input are made storable, or refused, before PostgreSQL sees them."""

from __future__ import annotations

import json
import math
import sys
import uuid
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs.queue import RETRY_DELAY_MAX, ClaimedJob, InvalidResult, Outcome, text
from tests.support.storable import encoded_as_before
from tests.support.timing import cost_ratio


def claimed() -> ClaimedJob:
    return ClaimedJob(1, "j-1", "a.v1", {}, "default", "default", 0, 1, 3, uuid.uuid4(), 0.0)


@pytest.mark.parametrize(
    "raw, stored",
    [
        ("boom\x00here", "boom\\x00here"),
        ("lone \ud800 surrogate", "lone \\ud800 surrogate"),
        ("fine: ünïcødé 🎉", "fine: ünïcødé 🎉"),
    ],
)
def test_error_text_is_cleaned(raw, stored):
    outcome = Outcome.failed(claimed(), code="handler_error", detail=raw)
    assert outcome.detail == stored
    assert text.problem(outcome.detail) is None
    assert Outcome.retry(claimed(), code="x", detail=raw).detail == stored


@pytest.mark.parametrize(
    "result, why",
    [
        (math.nan, "Out of range float values are not JSON compliant"),
        ({"a": [1, math.inf]}, "Out of range float values are not JSON compliant"),
        ({"a": "x\x00y"}, "a string contains a NUL character .*: \\$\\.a"),
        (["ok", "\udcff"], "lone surrogate .*: \\$\\[1\\]"),
        ({"k\x00": 1}, "NUL character .*key 'k\\\\x00' of \\$"),
        (object(), "Object of type object is not JSON serializable"),
    ],
)
def test_results_are_encoded_strictly(result, why):
    with pytest.raises(InvalidResult, match=why):
        Outcome.succeeded(claimed(), result)


def test_a_backslash_before_u0000_is_text_not_a_nul():
    assert Outcome.succeeded(claimed(), {"a": "\\u0000"}).result_json == '{"a":"\\\\u0000"}'


@pytest.mark.parametrize(
    "delay, seconds",
    [
        (timedelta.max, RETRY_DELAY_MAX.total_seconds()),
        (math.inf, RETRY_DELAY_MAX.total_seconds()),
        (math.nan, 0.0),
        (-5, 0.0),
        (2.5, 2.5),
    ],
)
def test_retry_delays_are_clamped(delay, seconds):
    assert Outcome.retry(claimed(), code="handler_error", delay=delay).delay == seconds


def test_long_details_keep_their_last_line():
    from jobs.queue.outcomes import MAX_DETAIL, _bounded

    detail = "Traceback\n" + "  frame\n" * 5000 + "ValueError: the cause"
    bounded = _bounded(detail)
    assert len(bounded) == MAX_DETAIL
    assert bounded.startswith("Traceback") and bounded.endswith("ValueError: the cause")
    assert "characters cut" in bounded


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=6,
    )
)
def test_results_encode_as_the_strict_encoder_writes_them(result):
    """Whatever shortcut the encoding takes, a result is stored as strict JSON writes it, or
    refused (NaN, infinities) as strict JSON refuses it."""
    try:
        expected = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        with pytest.raises(ValueError):
            text.dumps(result)
        return
    if text.check_json_text(expected) is None:
        assert text.dumps(result) == expected


class Text(str):
    pass


class Number(int):
    def __repr__(self) -> str:
        return "not JSON"


class Items(dict):
    pass


def cyclic() -> list[object]:
    loop: list[object] = [1]
    loop.append({"again": loop})
    return loop


JSON_LIKE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=5)
    | st.builds(Text, st.text(max_size=3))
    | st.builds(Number, st.integers())
    | st.sampled_from([object(), b"bytes", {1, 2}, 1j]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(
            st.text(max_size=3) | st.integers() | st.floats() | st.booleans() | st.none(), inner
        )
        | st.builds(Items, st.dictionaries(st.text(max_size=3), inner))
        | st.builds(lambda item: [item, cyclic()], inner)
    ),
    max_leaves=6,
)


@given(JSON_LIKE)
def test_any_value_encodes_or_is_refused_as_the_encoder_did_on_every_call(value):
    """The encoding function made once writes what ``JSONEncoder.encode`` writes, and a value
    it cannot write (a cycle, a type JSON lacks, a NaN) is refused with the same message."""
    try:
        expected = encoded_as_before(value)
    except ValueError as exc:
        with pytest.raises(ValueError) as refused:
            text.dumps(value)
        assert str(refused.value) == str(exc)
        return
    assert text.dumps(value) == expected


def test_a_small_payload_is_encoded_by_the_function_made_once():
    """What it is for: encoding a job's payload costs clearly less than making the encoding
    function again for it (about half)."""
    payload = {"n": 5, "name": "ada"}
    ratio = cost_ratio(lambda: text.dumps(payload), lambda: encoded_as_before(payload))
    assert ratio < 0.75, ratio  # about 0.5


@pytest.mark.parametrize("box", [list, dict])
def test_a_bad_string_nested_deeper_than_pythons_limit_is_refused_with_its_path(box):
    """The encoder writes values nested deeper than Python's recursion limit (its own limit
    is the C stack's: 1,500 levels on Python 3.12, 10,000 on 3.13), then the search for the
    string the database would refuse recursed in Python and raised RecursionError, not the
    ValueError that enqueue turns into InvalidJob."""
    depth = 1_200  # past Python's default limit of 1,000 (Hypothesis raises it meanwhile)

    def nested(inner: str) -> object:
        value: object = inner
        for _ in range(depth):
            value = [value] if box is list else {"d": value}
        return value

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000)
    try:
        assert text.dumps(nested("ab"))  # the encoder itself writes this depth
        with pytest.raises(ValueError, match="NUL character") as refused:
            text.dumps(nested("a\x00b"))
    finally:
        sys.setrecursionlimit(limit)
    step = "[0]" if box is list else ".d"
    assert str(refused.value).endswith("$" + step * depth)


def located_as_before(value: object, path: str = "$") -> str:
    """``text._locate`` as it was: recursive (and so bounded by Python's recursion limit)."""
    if isinstance(value, str):
        return path if text.problem(value) else ""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and text.problem(key):
                return f"key {key!r} of {path}"
            found = located_as_before(item, f"{path}.{key}")
            if found:
                return found
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = located_as_before(item, f"{path}[{index}]")
            if found:
                return found
    return ""


STORABLE_OR_NOT = st.recursive(
    st.none() | st.integers() | st.sampled_from(["ok", "a\x00b", "\udcff", "é"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.sampled_from(["k", "k\x00", "\ud800", 1]), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(STORABLE_OR_NOT)
def test_the_first_refused_string_is_found_where_the_recursive_search_found_it(value):
    """The search runs as a loop now; for any value it names the same place, or none."""
    assert text._locate(value) == located_as_before(value)
