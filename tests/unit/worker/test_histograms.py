"""The worker's histograms expose what prometheus_client's own Histogram would, for any values."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from jobs.worker.metrics import TypeHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)

# The bounds themselves and values either side of them, besides any float.
VALUES = st.one_of(
    st.sampled_from([*BUCKETS, 0.0, -0.0, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(BUCKETS).map(lambda bound: math.nextafter(bound, math.inf)),
)


def samples(families, name: str) -> dict[tuple, float]:
    """(suffix, labels) -> value of the family's samples; a _created one's value is when its
    series began, so only that it is there counts (as 0)."""
    found = {}
    for family in families:
        for sample in family.samples:
            suffix = sample.name.removeprefix(name)
            value = 0.0 if suffix == "_created" else sample.value
            found[suffix, tuple(sorted(sample.labels.items()))] = value
    return found


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@given(observed=st.lists(st.tuples(st.sampled_from(["a.v1", "b.v1"]), VALUES), max_size=40))
def test_any_observations_expose_as_the_library_histogram_would(observed):
    ours = TypeHistogram("ours_seconds", "Ours.", BUCKETS)
    reference = Histogram(
        "theirs_seconds", "Theirs.", ["job_type"], buckets=BUCKETS, registry=CollectorRegistry()
    )
    for name, _ in observed:  # a type's series exists once it is looked up, as theirs
        ours.labels(name)
        reference.labels(name)
    for name, value in observed:
        ours.labels(name).observe(value)
        reference.labels(name).observe(value)
    got = samples(ours.collect(), "ours_seconds")
    want = samples(reference.collect(), "theirs_seconds")
    assert got.keys() == want.keys()
    assert all(same(got[key], want[key]) for key in want), (got, want)


def test_the_created_series_follows_the_library_switch():
    """prometheus_client.disable_created_metrics() drops _created from the worker's
    histograms too, as from the library's own metrics."""
    from prometheus_client import disable_created_metrics, enable_created_metrics

    ours = TypeHistogram("switch_seconds", "Ours.", BUCKETS)
    ours.labels("a.v1").observe(0.2)
    assert ("_created", (("job_type", "a.v1"),)) in samples(ours.collect(), "switch_seconds")
    disable_created_metrics()
    try:
        kinds = {suffix for suffix, _ in samples(ours.collect(), "switch_seconds")}
    finally:
        enable_created_metrics()
    assert kinds == {"_bucket", "_count", "_sum"}
