"""The console's SVG charts: marks carry their numbers, stacks add up, no data says so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.admin import charts, windows
from tests.support.dom import Elements, marks

START = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def starts(n: int, step: timedelta = MINUTE) -> list[datetime]:
    return [START + step * k for k in range(n)]


def chart(series, n: int = 4, **fields) -> charts.Chart:
    return charts.Chart(
        name=fields.pop("name", "c"),
        title="A chart",
        starts=starts(n, fields.pop("step", MINUTE)),
        step=MINUTE,
        series=series,
        empty="Nothing here.",
        **fields,
    )


def test_stacked_bars_mark_each_segment_and_total_each_bin():
    ok = charts.Series("succeeded", "succeeded", [3, 0, 1, None], "#0a0", href="/ok/", total=4)
    bad = charts.Series("failed", "failed", [1, 2, 0, None], "#a00", total=3)
    page = Elements(charts.stacked_bars(chart([ok, bad], href="/all/", link_text="All")))

    assert marks(page, "c") == {
        "succeeded": {START.isoformat(): 3, (START + 2 * MINUTE).isoformat(): 1},
        "failed": {START.isoformat(): 1, (START + MINUTE).isoformat(): 2},
    }
    totals = [b["data-total"] for b in page.select("g", "c", **{"class": "jobs-bin"})]
    assert totals == ["4", "2", "1", "0"]  # a None is no data: counted as nothing
    legend = {li["data-series"]: li["data-total"] for li in page.select("li", "c")}
    assert legend == {"succeeded": "4", "failed": "3"}
    hrefs = [a["href"] for a in page.select("a", "c")]
    assert hrefs.count("/ok/") == 3 and "/all/" in hrefs  # two segments and the legend


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.one_of(st.none(), st.integers(0, 10_000)), min_size=6, max_size=6),
        min_size=1,
        max_size=5,
    )
)
def test_the_segments_of_a_bin_add_up_to_its_total(rows):
    series = [charts.Series(f"s{i}", f"s{i}", row, "#123") for i, row in enumerate(rows)]
    markup = charts.stacked_bars(chart(series, n=6))
    page = Elements(markup)
    expected = [sum(row[k] or 0 for row in rows) for k in range(6)]
    if not any(expected):
        assert page.select("figure", data_empty="true")
        return
    found = marks(page, "c")
    for k, start in enumerate(starts(6)):
        stamp = start.isoformat()
        [bin_] = page.select("g", "c", data_start=stamp)
        assert int(bin_["data-total"]) == expected[k]
        assert sum(values.get(stamp, 0) for values in found.values()) == expected[k]
    # Heights are proportional: the tallest stack fits the plot exactly or less.
    heights: dict[str, float] = {}
    for rect in page.select("rect", "c", **{"class": "jobs-mark"}):
        heights[rect["data-start"]] = heights.get(rect["data-start"], 0) + float(rect["height"])
    assert max(heights.values()) <= charts.PLOT_H + 0.05


def test_names_are_escaped_everywhere():
    evil = '<script>alert("x")</script>&'
    line = charts.Series(evil, evil, [1, 2, 3, 4], '"><b>', href='/x/?a=1&b="2"')
    markup = str(charts.lines(chart([line], name=evil, href="/?q=<i>")))
    assert "<script>" not in markup and "<b>" not in markup and "<i>" not in markup
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in markup
    assert 'href="/x/?a=1&amp;b=&quot;2&quot;"' in markup
    page = Elements(markup)
    assert {m["data-series"] for m in page.select("circle")} == {evil}  # round-trips


def test_no_data_is_said_in_words_not_drawn_as_zero():
    nothing = charts.Series("p95", "p95", [None] * 4, "#000")
    for draw in (charts.lines, charts.stacked_bars):
        page = Elements(draw(chart([nothing], note="A note.")))
        [figure] = page.select("figure")
        assert figure["data-empty"] == "true"
        assert not page.select("svg") and page.select("p", **{"class": "jobs-nodata"})
    assert "Nothing here." in charts.lines(chart([nothing]))


def test_a_line_breaks_where_a_bin_has_no_value():
    gaps = charts.Series("q", "queued", [5, 6, None, 7], "#000")
    page = Elements(charts.lines(chart([gaps])))
    [path] = page.select("path")
    assert path["d"].count("M") == 2  # two runs: bins 0-1 and bin 3
    assert list(marks(page, "c")["q"].values()) == [5, 6, 7]


def test_bins_older_than_the_history_kept_are_shaded_and_hold_no_marks():
    old = charts.Series("s", "s", [9, 9, 1, 2], "#000")
    page = Elements(charts.stacked_bars(chart([old], pruned=2, note="History is kept…")))
    [shade] = page.select("rect", **{"class": "jobs-pruned"})
    assert shade["data-pruned"] == "2"
    assert sum(marks(page, "c")["s"].values()) == 3
    assert len(page.select("g", **{"class": "jobs-bin"})) == 2


def test_time_ticks_fall_on_round_local_times():
    labels = [label for _i, label in charts.time_ticks(starts(60), MINUTE)]
    assert labels == ["10:00", "10:10", "10:20", "10:30", "10:40", "10:50"]
    six_hours = timedelta(hours=6)
    week = [START.replace(hour=0) + six_hours * k for k in range(28)]
    with timezone.override(ZoneInfo("Asia/Kolkata")):  # +05:30: no bin starts at midnight
        ticks = charts.time_ticks(week, six_hours)
    assert len(ticks) == 7  # a label per day, on the bin that holds local midnight
    assert all(label.startswith("Dec") for _i, label in ticks)


@pytest.mark.parametrize(
    ("maximum", "whole", "top"),
    [(7, True, 8), (1, True, 1), (0.9, False, 1.0), (0.003, False, 0.003), (1234, True, 1500)],
)
def test_axis_ticks_end_on_a_round_number_at_or_above_the_largest_value(maximum, whole, top):
    ticks = charts._nice(maximum, whole=whole)
    assert ticks[0] == 0 and ticks[-1] == pytest.approx(top) and len(ticks) <= 6


def test_a_sparkline_lists_its_values_and_marks_lone_points():
    markup = charts.sparkline([1, None, 3, 4, None], label="attempts")
    [svg] = Elements(markup).select("svg")
    assert svg["data-values"] == "1,,3,4,"
    assert Elements(markup).select("circle")  # the lone first point
    assert "attempts: 1 to 4" in markup
    empty = charts.sparkline([None, None], label="p95")
    assert "no data" in empty and "<path" not in empty


def test_a_window_ends_with_the_bin_now_falls_in():
    now = datetime(2026, 12, 2, 10, 17, 42, tzinfo=UTC)
    hour = windows.frame(windows.WINDOWS["hour"], now)
    assert len(hour.starts) == 60 and hour.since == datetime(2026, 12, 2, 9, 18, tzinfo=UTC)
    assert hour.until == datetime(2026, 12, 2, 10, 18, tzinfo=UTC)
    week = windows.frame(windows.WINDOWS["week"], now)
    assert len(week.starts) == 28 and week.starts[-1] == datetime(2026, 12, 2, 6, tzinfo=UTC)
    assert week.index(datetime(2026, 12, 2, 6, tzinfo=UTC)) == 27
    assert week.index(datetime(2026, 12, 2, 7, tzinfo=UTC)) is None  # not a bin start
