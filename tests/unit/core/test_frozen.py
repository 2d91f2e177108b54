"""``direct_init``: the frozen values made once a job are built as their dataclass builds
them, by a cheaper ``__init__``.

The guarantee is about any call: for any arguments, given by position or by name or left to
their defaults, the value is the one the dataclass's own ``__init__`` builds, and a call it
refuses is refused alike. Hypothesis draws the calls for every class that uses it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobs.api.producer import JobSpec
from jobs.core.frozen import direct_init
from jobs.queue import ClaimedJob, Enqueued, NewJob, Outcome
from tests.support.timing import cost_ratio

HOT = (NewJob, Enqueued, ClaimedJob, Outcome, JobSpec)


@direct_init
@dataclass(frozen=True, slots=True)
class Sample:
    first: int
    second: str = "two"
    third: list[int] = field(default_factory=list)
    fourth: int = field(default=4, kw_only=True)
    fifth: str = field(kw_only=True)


any_value = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers()))


def in_order(cls) -> list[dataclasses.Field]:
    """The fields in ``__init__``'s order: keyword-only ones last."""
    return sorted(dataclasses.fields(cls), key=lambda f: bool(f.kw_only))


def required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@st.composite
def calls(draw, cls):
    """Arguments for ``cls``: some by position, then by name every required one left and
    some of the others."""
    fields = in_order(cls)
    positional = [f for f in fields if not f.kw_only]
    args = [draw(any_value) for _ in range(draw(st.integers(0, len(positional))))]
    kwargs = {
        f.name: draw(any_value) for f in fields[len(args) :] if required(f) or draw(st.booleans())
    }
    return args, kwargs


def a_call(cls):
    return [], {f.name: 0 for f in dataclasses.fields(cls) if required(f)}


def built_by_the_dataclass(cls, args, kwargs):
    value = object.__new__(cls)
    cls.__init__.__wrapped__(value, *args, **kwargs)
    return value


@pytest.mark.parametrize("cls", [*HOT, Sample], ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_any_call_builds_what_the_dataclass_builds(cls, data):
    args, kwargs = data.draw(calls(cls))
    given_values = {f.name for f in in_order(cls)[: len(args)]} | set(kwargs)

    built = cls(*args, **kwargs)
    expected = built_by_the_dataclass(cls, args, kwargs)

    assert built == expected
    for f in dataclasses.fields(cls):
        if f.name in given_values or f.default_factory is dataclasses.MISSING:
            assert getattr(built, f.name) is getattr(expected, f.name)  # the very value
        else:
            assert getattr(built, f.name) == getattr(expected, f.name)  # a factory's new one


@pytest.mark.parametrize("cls", [*HOT, Sample], ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_a_call_the_dataclass_refuses_is_refused_alike(cls, data):
    names = [f.name for f in dataclasses.fields(cls)]
    args = data.draw(st.lists(any_value, max_size=len(names) + 2))
    extra = data.draw(st.dictionaries(st.sampled_from([*names, "unknown"]), any_value))
    try:
        built_by_the_dataclass(cls, args, extra)
    except TypeError:
        with pytest.raises(TypeError):
            cls(*args, **extra)
    else:
        assert cls(*args, **extra) == built_by_the_dataclass(cls, args, extra)


def test_each_value_gets_a_new_default_from_its_factory():
    assert Sample(1, fifth="5").third is not Sample(1, fifth="5").third
    assert NewJob("a.v1").payload is not NewJob("a.v1").payload


@pytest.mark.parametrize("cls", [*HOT, Sample], ids=lambda cls: cls.__name__)
def test_the_class_keeps_its_signature_and_stays_frozen(cls):
    wrapped = cls.__init__.__wrapped__
    assert inspect.signature(cls) == inspect.signature(wrapped).replace(
        parameters=list(inspect.signature(wrapped).parameters.values())[1:]
    )
    value = built_by_the_dataclass(cls, *a_call(cls))
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.__setattr__(dataclasses.fields(cls)[0].name, 1)
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


@pytest.mark.parametrize("cls", HOT, ids=lambda cls: cls.__name__)
def test_the_values_made_once_a_job_are_built_the_cheaper_way(cls):
    """What it is for: building one costs clearly less than the dataclass's own way."""
    args, kwargs = a_call(cls)
    ratio = cost_ratio(
        lambda: cls(*args, **kwargs), lambda: built_by_the_dataclass(cls, args, kwargs)
    )
    assert ratio < 0.8, ratio  # about 0.45


def test_shapes_it_would_build_differently_are_refused():
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class NotInInit:
        a: int
        b: int = field(default=0, init=False)

    @dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int] = 0

    @dataclass(frozen=True, slots=True)
    class Inherited(Sample):
        sixth: int = 6

    @dataclass(frozen=True, slots=True)
    class Private:
        _a: int

    classes = (NoSlots, NotFrozen, PostInit, NotInInit, WithInitVar, Inherited, Private, object)
    for cls in classes:
        with pytest.raises(TypeError, match="direct_init"):
            direct_init(cls)
