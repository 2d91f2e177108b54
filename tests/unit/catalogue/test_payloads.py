"""Typed payloads: names, the strict JSON codec, validation and round trips."""

from __future__ import annotations

import enum
import json
from dataclasses import FrozenInstanceError, dataclass
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

import pytest
from django.core.exceptions import ValidationError
from hypothesis import given
from hypothesis import strategies as st

from jobs import InvalidPayload, Payload
from jobs.catalogue import payloads as payloads_module
from jobs.catalogue.payloads import (
    _decode,
    _decode_dataclass,
    _decoder,
    checked_json,
    payload_problems,
)

EMAIL_ID = UUID("6f1c1f0e-8a6e-4c55-9a39-0d2d7f0b5c11")


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Size(enum.IntEnum):
    SMALL = 1
    LARGE = 2


@dataclass(frozen=True)
class Line:
    sku: str
    qty: int

    def validate(self) -> None:
        if self.qty < 1:
            raise ValueError("qty must be at least 1")


class SendEmailV1(Payload, name="email.send.v1"):
    email_id: UUID

    def validate(self) -> None:
        if self.email_id.int == 0:
            raise ValueError("email_id must not be the zero UUID")


class OrderV1(Payload, name="shop.order.v1"):
    order_id: int
    total: Decimal
    placed_at: datetime
    ship_on: date
    colour: Colour
    size: Size
    lines: tuple[Line, ...]
    weight: float = 0.0
    gift: bool = False
    note: str | None = None
    tags: list[str] | None = None
    attributes: dict[str, int] | None = None
    channel: Literal["web", "shop"] = "web"
    extra: Any = None


class ClosedV1(Payload, name="shop.closed.v1"):
    reason: str

    def validate(self) -> None:
        if not self.reason:
            raise ValidationError("reason is required")


def order(**changes: Any) -> OrderV1:
    fields: dict[str, Any] = {
        "order_id": 7,
        "total": Decimal("12.50"),
        "placed_at": datetime(2025, 3, 1, 12, 30, tzinfo=UTC),
        "ship_on": date(2025, 3, 4),
        "colour": Colour.RED,
        "size": Size.LARGE,
        "lines": (Line(sku="a-1", qty=2), Line(sku="b-2", qty=1)),
    }
    return OrderV1(**{**fields, **changes})


def order_json(**changes: Any) -> dict[str, Any]:
    return {**order().to_json(), **changes}


def error(data: object, cls: type[Payload] = OrderV1) -> str:
    with pytest.raises(InvalidPayload) as info:
        cls.from_json(data)
    return str(info.value)


class TestDefinition:
    def test_name_and_frozen_keyword_only_dataclass(self):
        payload = SendEmailV1(email_id=EMAIL_ID)
        assert SendEmailV1.job_name == "email.send.v1"
        with pytest.raises(FrozenInstanceError):
            payload.email_id = EMAIL_ID  # type: ignore[misc]
        with pytest.raises(TypeError):
            SendEmailV1(EMAIL_ID)  # type: ignore[misc]

    def test_hashable_and_comparable(self):
        assert SendEmailV1(email_id=EMAIL_ID) == SendEmailV1(email_id=EMAIL_ID)
        assert len({SendEmailV1(email_id=EMAIL_ID), SendEmailV1(email_id=EMAIL_ID)}) == 1
        assert hash(order()) == hash(order())

    @pytest.mark.parametrize(
        "name",
        ["email.send", "Email.send.v1", "email..send.v1", "email.send.v0", "v1", "email send.v1"],
    )
    def test_invalid_names_are_refused(self, name):
        with pytest.raises(TypeError, match="invalid job name"):

            class Bad(Payload, name=name):
                x: int

    def test_a_name_is_required(self):
        with pytest.raises(TypeError, match="must declare its versioned name"):

            class Nameless(Payload):
                x: int

    def test_reserved_field_names_are_refused(self):
        with pytest.raises(TypeError, match=r"\['validate'\] are reserved"):

            class Clash(Payload, name="clash.v1"):
                validate: int  # type: ignore[assignment]

    def test_unsupported_field_types_are_reported(self):
        class Odd(Payload, name="odd.v1"):
            ids: set[int]
            by_number: dict[int, str]

        assert payload_problems(Odd) == [
            f"{Odd.__qualname__}.ids: unsupported field type set[int]",
            f"{Odd.__qualname__}.by_number: object keys must be str in JSON",
        ]
        assert payload_problems(OrderV1) == []
        assert payload_problems(dict) == ["<class 'dict'> is not a subclass of jobs.Payload"]


class TestRoundTrip:
    def test_to_json_is_plain_json(self):
        data = order(note="fragile", tags=["a"], attributes={"k": 1}).to_json()
        assert data == {
            "order_id": 7,
            "total": "12.50",
            "placed_at": "2025-03-01T12:30:00+00:00",
            "ship_on": "2025-03-04",
            "colour": "red",
            "size": 2,
            "lines": [{"sku": "a-1", "qty": 2}, {"sku": "b-2", "qty": 1}],
            "weight": 0.0,
            "gift": False,
            "note": "fragile",
            "tags": ["a"],
            "attributes": {"k": 1},
            "channel": "web",
            "extra": None,
        }
        assert json.loads(json.dumps(data)) == data

    @pytest.mark.parametrize(
        "payload",
        [
            order(),
            order(note="n", tags=["x", "y"], attributes={"a": 1}, channel="shop", gift=True),
            order(extra={"free": ["form", 1]}, weight=2.5, lines=()),
            SendEmailV1(email_id=EMAIL_ID),
        ],
    )
    def test_from_json_of_to_json_is_the_same_payload(self, payload):
        cls = type(payload)
        assert cls.from_json(payload.to_json()) == payload
        assert cls.from_json(json.dumps(payload.to_json())) == payload
        assert cls.from_json(json.dumps(payload.to_json()).encode()) == payload

    def test_decoded_values_have_the_annotated_types(self):
        decoded = OrderV1.from_json(order_json(weight=3))
        assert isinstance(decoded.total, Decimal) and isinstance(decoded.placed_at, datetime)
        assert decoded.colour is Colour.RED and decoded.size is Size.LARGE
        assert decoded.lines[0] == Line(sku="a-1", qty=2) and isinstance(decoded.lines, tuple)
        assert decoded.weight == 3.0 and isinstance(decoded.weight, float)

    def test_offsets_other_than_utc_are_kept(self):
        plus_two = timezone(timedelta(hours=2))
        decoded = OrderV1.from_json(order_json(placed_at="2025-03-01T14:30:00+02:00"))
        assert decoded.placed_at == datetime(2025, 3, 1, 14, 30, tzinfo=plus_two)


class TestStrictDecoding:
    @pytest.mark.parametrize(
        ("data", "message"),
        [
            ([], "expected a JSON object, got list"),
            (None, "expected a JSON object, got null"),
            ("[1]", "expected a JSON object, got list"),
            ('{"email_id": "6f1c1f0e-8a6e-4c55-9a39-0d2d7f0b5c11"} {}', "invalid JSON: Extra data"),
            ('{"email_id": 1, "email_id": 2}', "invalid JSON: duplicate key 'email_id'"),
            ('{"email_id": NaN}', "invalid JSON: NaN is not allowed"),
            (b"\xff", "invalid JSON"),
            ({}, "missing required field 'email_id'"),
            ({"email_id": str(EMAIL_ID), "cc": 1, "bcc": 2}, "unknown fields 'bcc', 'cc'"),
            ({"email_id": "nope"}, "email_id: expected a UUID string, got 'nope'"),
            ({"email_id": 5}, "email_id: expected a UUID string, got int"),
        ],
    )
    def test_envelope_errors(self, data, message):
        assert error(data, SendEmailV1).startswith(message)

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"order_id": "7"}, "order_id: expected int, got str"),
            ({"order_id": True}, "order_id: expected int, got bool"),
            ({"order_id": 7.0}, "order_id: expected int, got float"),
            ({"weight": "1"}, "weight: expected float, got str"),
            ({"weight": False}, "weight: expected float, got bool"),
            ({"gift": 1}, "gift: expected bool, got int"),
            ({"note": 3}, "note: expected str, got int"),
            ({"total": 1.5}, "total: expected a decimal string, got float"),
            ({"total": "abc"}, "total: expected a decimal string, got 'abc'"),
            ({"total": "NaN"}, "total: expected a finite decimal, got 'NaN'"),
            (
                {"placed_at": "2025-03-01T12:30:00"},
                "placed_at: expected an ISO 8601 datetime with a UTC offset, "
                "got '2025-03-01T12:30:00'",
            ),
            (
                {"ship_on": "2025-03-04T00:00:00"},
                "ship_on: expected an ISO 8601 date, got '2025-03-04T00:00:00'",
            ),
            ({"colour": "green"}, "colour: expected one of 'red', 'blue', got 'green'"),
            ({"size": True}, "size: expected one of 1, 2, got True"),
            ({"channel": "fax"}, "channel: expected one of 'web', 'shop', got 'fax'"),
            ({"lines": {"sku": "a"}}, "lines: expected a list, got dict"),
            ({"lines": [{"sku": "a", "qty": 1}, 5]}, "lines[1]: expected a JSON object, got int"),
            (
                {"lines": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": "2"}]},
                "lines[1].qty: expected int, got str",
            ),
            ({"lines": [{"sku": "a"}]}, "lines[0]: missing required field 'qty'"),
            ({"lines": [{"sku": "a", "qty": 1, "x": 0}]}, "lines[0]: unknown field 'x'"),
            ({"tags": ["a", 2]}, "tags[1]: expected str, got int"),
            ({"attributes": {"k": "v"}}, 'attributes["k"]: expected int, got str'),
        ],
    )
    def test_field_errors_name_the_path(self, changes, message):
        assert error(order_json(**changes)) == message

    def test_optional_fields_accept_null_and_defaults_fill_in(self):
        data = order_json(note=None)
        del data["gift"]
        decoded = OrderV1.from_json(data)
        assert (decoded.note, decoded.gift) == (None, False)

    def test_python_values_of_the_right_type_are_accepted(self):
        decoded = SendEmailV1.from_json({"email_id": EMAIL_ID})
        assert decoded.email_id == EMAIL_ID


class TestValidateHook:
    def test_value_error_becomes_invalid_payload(self):
        zero = "00000000-0000-0000-0000-000000000000"
        assert error({"email_id": zero}, SendEmailV1) == "email_id must not be the zero UUID"

    def test_django_validation_error_is_accepted(self):
        assert error({"reason": ""}, ClosedV1) == "reason is required"

    def test_nested_dataclass_validate_names_its_path(self):
        message = error(order_json(lines=[{"sku": "a", "qty": 1}, {"sku": "b", "qty": 0}]))
        assert message == "lines[1]: qty must be at least 1"

    def test_invalid_payload_is_a_value_error(self):
        assert issubclass(InvalidPayload, ValueError)
        exc = InvalidPayload("expected int, got str", "items[2].qty")
        assert (exc.path, exc.reason) == ("items[2].qty", "expected int, got str")

    def test_validate_is_not_run_by_the_constructor(self):
        # Constructing is cheap; the producer and the worker run validate() on the way in/out.
        assert SendEmailV1(email_id=UUID(int=0)).email_id.int == 0


class TestEncoding:
    def test_values_json_cannot_hold_are_refused_with_a_path(self):
        with pytest.raises(InvalidPayload, match=r"^extra\[1\]: cannot encode set as JSON$"):
            order(extra=[1, {2}]).to_json()
        with pytest.raises(InvalidPayload, match=r"^extra: object keys must be str, got int$"):
            order(extra={1: "a"}).to_json()


# -- the per-class decoders agree with the generic decoding ---------------------------------

_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: they must be refused the same way
    | st.text(max_size=5)
    | st.sampled_from([Size.SMALL, Colour.RED, 1.0, True, 0]),  # not exact JSON types
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=5,
)


def _outcome(decode, value):
    try:
        result = decode(value, "field")
    except InvalidPayload as exc:
        return ("refused", str(exc))
    return ("decoded", type(result), result)


@given(
    tp=st.sampled_from([str, int, float, bool, Any, tuple[int, ...], int | None]), value=_JSONISH
)
def test_a_fields_decoder_decodes_and_refuses_as_the_generic_decoding(tp, value):
    fast = _outcome(_decoder(tp), value)
    generic = _outcome(lambda v, p: _decode(tp, v, p), value)
    if fast[0] == "decoded" and isinstance(fast[2], float) and fast[2] != fast[2]:
        assert generic[0] == "decoded" and generic[2] != generic[2]  # NaN is not NaN
    else:
        assert fast == generic


# -- the producer's check: checked_json against the full round trip ---------------------------


class Plain(Payload, name="test.plain.v1"):
    s: str
    i: int
    b: bool
    f: float = 0.5


class PlainChecked(Payload, name="test.plain_checked.v1"):
    i: int

    def validate(self) -> None:
        if self.i < 0:
            raise ValueError("i must not be negative")


class PlainPostInit(Payload, name="test.plain_post_init.v1"):
    i: int

    def __post_init__(self) -> None:
        if self.i == 13:
            raise ValueError("unlucky")


def _round_trip(payload):
    try:
        data = payload.to_json()
        type(payload).from_json(data)
    except InvalidPayload as exc:
        return ("refused", str(exc))
    return ("stored", data)


def _checked(payload):
    try:
        data = checked_json(payload)
    except InvalidPayload as exc:
        return ("refused", str(exc))
    return ("stored", data)


# Any value at all: a frozen dataclass does not check its fields' types when built.
_ANY_VALUE = _JSONISH | st.sampled_from([float("nan"), float("inf"), 2**70, "\x00", Colour.RED])


def _assert_checked_as_round_trip(payload):
    checked = _checked(payload)
    assert checked == _round_trip(payload)
    if checked[0] == "stored":  # the same types too: 1 == 1.0 == True
        assert list(map(type, checked[1].values())) == list(map(type, payload.to_json().values()))


@given(
    # Values of the field's type (NaN and infinities among the floats) or a near miss: a bool
    # for an int, 0 or 1 for a bool, an int for a float, an enum member for a str.
    s=st.text(max_size=3) | st.just(Colour.RED),
    i=st.integers() | st.booleans(),
    b=st.booleans() | st.integers(0, 1),
    f=st.floats() | st.integers(),
)
def test_checked_json_stores_values_of_the_fields_types_as_the_full_round_trip(s, i, b, f):
    _assert_checked_as_round_trip(Plain(s=s, i=i, b=b, f=f))


@given(
    s=st.text(max_size=3) | _ANY_VALUE,
    i=st.integers() | _ANY_VALUE,
    b=st.booleans() | _ANY_VALUE,
    f=st.floats() | _ANY_VALUE,
)
def test_checked_json_stores_and_refuses_any_values_as_the_full_round_trip(s, i, b, f):
    _assert_checked_as_round_trip(Plain(s=s, i=i, b=b, f=f))


@given(i=st.integers(min_value=-3, max_value=20) | _ANY_VALUE)
def test_checked_json_runs_validate_and_post_init_as_the_full_round_trip(i):
    checked = PlainChecked(i=i)
    assert _checked(checked) == _round_trip(checked)
    post_init = PlainPostInit.__new__(PlainPostInit)
    object.__setattr__(post_init, "i", i)  # built past __post_init__, as a bad producer might
    assert _checked(post_init) == _round_trip(post_init)


def test_a_negative_value_validate_refuses_is_refused_by_checked_json():
    with pytest.raises(InvalidPayload, match="i must not be negative"):
        checked_json(PlainChecked(i=-1))
    with pytest.raises(InvalidPayload, match="unlucky"):
        bad = PlainPostInit.__new__(PlainPostInit)
        object.__setattr__(bad, "i", 13)
        checked_json(bad)


# -- the worker's decode: from_json of a plain payload against the full decoding ---------------


def _decoded(cls, data):
    try:
        return ("decoded", cls.from_json(data))
    except InvalidPayload as exc:
        return ("refused", str(exc))


def _fully_decoded(cls, data):
    """What from_json does without a shortcut."""
    try:
        if isinstance(data, str | bytes | bytearray):
            data = payloads_module._parse(data)
        return ("decoded", _decode_dataclass(cls, data, ""))
    except InvalidPayload as exc:
        return ("refused", str(exc))


_PLAIN_KEYS = st.sampled_from(["s", "i", "b", "f", "extra"])


@given(
    data=st.dictionaries(_PLAIN_KEYS, _ANY_VALUE | st.floats() | st.integers() | st.booleans())
    | _ANY_VALUE
)
def test_a_plain_payload_decodes_any_data_as_the_full_decoding(data):
    """The worker decodes every job it runs: a plain payload (scalar fields, no validate or
    __post_init__) whose stored object holds exactly its fields, each of its type, is built
    from them at once; anything else takes the full decoding, so any data ends alike."""
    decoded = _decoded(Plain, data)
    assert decoded == _fully_decoded(Plain, data)
    if decoded[0] == "decoded":
        assert [type(getattr(decoded[1], k)) for k in "sibf"] == [
            type(getattr(_fully_decoded(Plain, data)[1], k)) for k in "sibf"
        ]


@given(i=st.integers(min_value=-3, max_value=20) | _ANY_VALUE)
def test_payloads_that_check_themselves_decode_as_the_full_decoding(i):
    for cls in (PlainChecked, PlainPostInit):
        assert _decoded(cls, {"i": i}) == _fully_decoded(cls, {"i": i})


def test_a_plain_payload_as_the_producer_stores_it_is_built_without_the_full_decoding(
    monkeypatch,
):
    """What it is for: the full decoding cost a worker 1.4 µs a job for a one-field payload,
    five times building it."""
    full = []
    real = payloads_module._decode_dataclass
    monkeypatch.setattr(payloads_module, "_decode_dataclass", lambda *a: full.append(a) or real(*a))
    stored = checked_json(Plain(s="x", i=1, b=True, f=2.5))

    assert Plain.from_json(stored) == Plain(s="x", i=1, b=True, f=2.5)
    assert full == []
    _decoded(Plain, {**stored, "i": True})  # a near miss (a bool for an int)...
    assert len(full) == 1  # ...takes the full decoding
