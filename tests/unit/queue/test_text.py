"""Outcomes and enqueue input are made storable, or refused, before PostgreSQL sees them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jobs.queue import (
    RETRY_DELAY_MAX,
    ClaimedJob,
    InvalidResult,
    Outcome,
    text,
)
from tests.support.timing import cost_ratio


def strict_json(value: object) -> str:
    """The oracle ``text.dumps`` is held to: the standard library's strict encoder, made anew
    for the call as ``json.dumps`` makes it, then the database's refusals of its text."""
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None
    bad = text.check_json_text(encoded)
    if bad:
        # The path finder has a test of its own against its definition, for shallow values.
        raise ValueError(f"{bad}: {text._locate(value)}")
    return encoded


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
def test_any_value_encodes_or_is_refused_as_the_standard_strict_encoder_does(value):
    """The encoding function made once writes what ``json.dumps`` writes, and a value it
    cannot write (a cycle, a type JSON lacks, a NaN) is refused with the same message."""
    try:
        expected = strict_json(value)
    except ValueError as exc:
        with pytest.raises(ValueError) as refused:
            text.dumps(value)
        assert str(refused.value) == str(exc)
        return
    assert text.dumps(value) == expected


def test_a_small_payload_is_encoded_by_the_function_made_once():
    """What it is for: encoding a job's payload costs clearly less than making the encoding
    function again for it, as ``json.dumps`` does (about half)."""
    payload = {"n": 5, "name": "ada"}
    ratio = cost_ratio(lambda: text.dumps(payload), lambda: strict_json(payload))
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


def first_refused_path(value: object, path: str = "$") -> str:
    """The path of the first string the database refuses, in the order the encoder writes
    ``value``: the definition, written recursively (so bounded by Python's recursion limit)."""
    if isinstance(value, str):
        return path if text.problem(value) else ""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and text.problem(key):
                return f"key {key!r} of {path}"
            found = first_refused_path(item, f"{path}.{key}")
            if found:
                return found
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = first_refused_path(item, f"{path}[{index}]")
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
def test_the_first_refused_string_is_named_by_its_path_in_the_order_the_text_is_written(value):
    """The search is a loop (values nest deeper than Python's recursion limit); for any value
    it names the place the recursive definition names, or none."""
    assert text._locate(value) == first_refused_path(value)


def outcome(encode, value: object) -> tuple[str, str]:
    try:
        return ("ok", encode(value))
    except ValueError as exc:
        return ("refused", str(exc))


class OddStr(str):
    def __str__(self) -> str:
        return "odd"

    def __repr__(self) -> str:
        return "odd"


class OddInt(int):
    def __repr__(self) -> str:
        return "not JSON"

    __str__ = __repr__


class OddFloat(float):
    def __repr__(self) -> str:
        return "not JSON"


class OddList(list):
    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


class OddTuple(tuple):
    def __iter__(self):
        return iter((1, 2, 3))


class OddItems(dict):
    """A dict whose items() says something else, the same on every call."""

    def items(self):
        return [(f"k{n}", value) for n, value in enumerate(reversed(list(self.values())))]


def self_loop(box: type) -> object:
    value = box()
    if isinstance(value, dict):
        value["me"] = value
    else:
        value.append(value)
    return value


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=4)
    | st.sampled_from(["a\x00b", "\ud800", "\\u0000", "é\U0001f600", object(), b"x", {1}, 1j])
    | st.builds(OddStr, st.text(max_size=3))
    | st.builds(OddInt, st.integers())
    | st.builds(OddFloat, st.floats())
)


KEYS = st.text(max_size=3) | st.integers() | st.floats() | st.booleans() | st.none()


ODD_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.builds(OddList, st.lists(inner, max_size=3))
        | st.builds(OddTuple, st.lists(inner, max_size=3))
        | st.dictionaries(KEYS | st.builds(OddInt, st.integers()) | st.just((1,)), inner)
        | st.builds(OddItems, st.dictionaries(st.text(max_size=2), inner, max_size=3))
        | st.builds(lambda item, box: [item, self_loop(box)], inner, st.sampled_from([list, dict]))
    ),
    max_leaves=8,
)


def nested(depth: int, box: type = list, inner: object = 0) -> object:
    value: object = inner
    for _ in range(depth):
        value = [value] if box is list else {"d": value}
    return value


@settings(max_examples=300, deadline=None)
@given(
    ODD_VALUES,
    st.sampled_from([0, 0, 0, 9_000, 9_990, 10_050, 50_000]),
    st.sampled_from([list, dict]),
)
@example(OddItems(a=self_loop(OddItems)), 0, list)
def test_dumps_writes_or_refuses_odd_values_as_the_standard_strict_encoder_does(value, depth, box):
    """Any value (subclasses of str, int, float, list, tuple and dict whose ``__repr__``,
    ``__iter__`` or ``items`` say something else, keys of every kind, NaN, NUL, lone
    surrogates, cycles), at the top or nested on either side of the recursion limit: ``dumps``
    writes what ``json.dumps`` writes, or refuses it with the same message.
    """
    value = nested(depth, box, value)
    assert outcome(text.dumps, value) == outcome(strict_json, value)


def test_dumps_from_many_threads_at_once_gives_each_value_its_own_answer():
    """The one encoding function is shared: 8 threads encoding at once, good values between
    refused ones (cycles, NaN, too deep, unserializable), each get the answer the strict
    encoder gives alone; a failure leaves nothing behind for the next call."""
    values = [{"n": n, "text": "é" * n, "list": list(range(n))} for n in range(5)] + [
        self_loop(list),
        {"x": float("nan")},
        nested(20_000),
        {"o": object()},
        OddItems(a=1, b=[2]),
        {1: "int key", None: "none key"},
    ]
    expected = [outcome(strict_json, value) for value in values]
    start = threading.Barrier(8)
    wrong: list[tuple] = []

    def work(offset: int) -> None:
        start.wait()
        for step in range(300):
            index = (offset + step) % len(values)
            got = outcome(text.dumps, values[index])
            if got != expected[index]:
                wrong.append((index, got))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert [outcome(text.dumps, value) for value in values] == expected


CYCLE_IN_A_THREAD = """
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("text_under_test", sys.argv[1])
text = importlib.util.module_from_spec(spec)
spec.loader.exec_module(text)
if sys.argv[2] == "standard":  # the control: the standard library's strict encoder
    import json
    text.dumps = lambda value: json.dumps(value, allow_nan=False)
threading.stack_size(1 << 20)  # python:alpine builds CPython with 1 MiB thread stacks
said = []
def run():
    loop = []
    loop.append({"again": loop})
    try:
        text.dumps({"payload": loop})
    except ValueError as exc:
        said.append(str(exc))
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(said)
"""


def refuse_a_cycle_in_a_thread(how: str) -> subprocess.CompletedProcess:
    source = Path(text.__file__)
    return subprocess.run(
        [sys.executable, "-c", CYCLE_IN_A_THREAD, str(source), how],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_cyclic_value_in_a_thread_with_a_1_mib_stack_is_refused_not_a_crash():
    """A handler thread (or a web server's) with a 1 MiB stack, as python:alpine's CPython makes
    them, hands ``dumps`` a result that refers to itself. The strict encoder sees the cycle at
    the second level and refuses it (the control run); so does ``dumps``, whose encoding
    function keeps the cycle check (``markers``), rather than recurse to the C recursion limit
    first, ~10,000 frames, and kill the process with a segmentation fault before any fallback
    can run.
    """
    control = refuse_a_cycle_in_a_thread("standard")
    assert control.returncode == 0, control.stderr
    assert "Circular reference detected" in control.stdout

    current = refuse_a_cycle_in_a_thread("dumps")
    assert current.returncode == 0, f"exit status {current.returncode}: {current.stderr}"
    assert "Circular reference detected" in current.stdout


class SelfOnce(dict):
    """A mapping whose first reading holds itself, later readings a plain value."""

    def __init__(self) -> None:
        super().__init__(x=1)
        self.reads = 0

    def items(self):
        self.reads += 1
        return [("self", self)] if self.reads == 1 else [("x", 1)]


def test_a_mapping_that_refers_to_itself_once_is_still_a_cycle():
    """The strict encoder refuses a container that holds itself the moment it meets it again
    ("Circular reference detected"); so does ``dumps``, rather than read the mapping a second
    time, find a plain value, and return ``{"self":{"x":1}}``.
    """
    assert outcome(strict_json, SelfOnce()) == ("refused", "Circular reference detected")
    assert outcome(text.dumps, SelfOnce()) == ("refused", "Circular reference detected")


class Failing(dict):
    reads = 0

    def items(self):
        Failing.reads += 1
        raise LookupError("the backing store is gone")


def test_a_refused_values_own_code_runs_once_and_its_error_stands_alone():
    """A payload's ``items()`` that raises runs once and its error comes out as raised: ``dumps``
    does not swallow it, run it again from a fallback, and raise the second error with the
    first as its ``__context__``.
    """
    Failing.reads = 0
    with pytest.raises(LookupError) as raised:
        text.dumps(Failing(a=1))
    assert Failing.reads == 1
    assert raised.value.__context__ is None
