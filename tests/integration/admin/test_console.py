"""The console's overview charts and performance page, for outcomes really written.

Attempts are claimed and ended through the queue, so the rollup rows are the ones the
outcome statements write; only data that must lie in the past is placed by hand (as rows in
the rollup's documented format). Numbers are read from the pages' data attributes.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.db.clock import database_now
from jobs.queue import rollup
from tests.support.admin import client_for, operator
from tests.support.dom import Elements, marks
from tests.support.rollup import end, put_history

pytestmark = pytest.mark.django_db

OVERVIEW = reverse("admin:jobs_overview")
PERFORMANCE = reverse("admin:jobs_performance")
PING, AUDIT = "jobapp.ping.v1", "jobapp.audit.v1"


@pytest.fixture
def viewer():
    return client_for(operator("viewer", "jobs.view_job"))


def page(client, url: str, **query: str) -> Elements:
    response = client.get(url, query)
    assert response.status_code == 200
    return Elements(response.content.decode())


def test_the_overview_charts_what_ended_this_minute_by_outcome_and_cause(viewer):
    end(
        [
            (PING, "succeeded", ""),
            (PING, "succeeded", ""),
            (AUDIT, "succeeded", ""),
            (PING, "failed", "handler_error"),
            (AUDIT, "failed", "rejected"),
            (AUDIT, "failed", "rejected"),
            (PING, "retried", "handler_error"),
        ]
    )
    html = page(viewer, OVERVIEW)

    finished = marks(html, "finished")
    [start] = finished["succeeded"]  # all in this minute's bin
    assert {s: v[start] for s, v in finished.items()} == {
        "succeeded": 3,
        "failed": 3,
        "retried": 1,
    }
    [this_bin] = html.select("g", "finished", data_start=start)
    assert this_bin["data-total"] == "7"
    assert len(html.select("g", "finished", **{"class": "jobs-bin"})) == 60  # minute bins
    assert marks(html, "failures") == {"rejected": {start: 2}, "handler_error": {start: 1}}
    legend = {li["data-series"]: li["data-total"] for li in html.select("li", "failures")}
    assert legend == {"rejected": "2", "handler_error": "1"}
    # The latency chart has a p50 and a p95 dot in the bin: the attempts waited ~0 s.
    assert set(marks(html, "latency")) == {"p50", "p95"}
    assert list(marks(html, "latency")["p95"]) == [start]


def test_the_overview_links_each_chart_and_series_to_its_filtered_list(viewer):
    end([(PING, "succeeded", ""), (PING, "failed", "handler_error")])
    rollup.record_backlog([(PING, 7, 3, 12.0)], at=database_now())
    html = page(viewer, OVERVIEW, window="day")
    links = {a["href"] for a in html.select("a")}
    monitor = reverse("admin:jobs_monitor")
    jobs = reverse("admin:jobs_job_changelist")
    assert f"{monitor}?state=succeeded&age=24h" in links
    assert f"{monitor}?state=failed&age=24h" in links
    assert f"{monitor}?error=handler_error&age=24h" in links
    assert f"{monitor}?age=24h" in links  # the failures chart
    assert f"{jobs}?state=queued&name={PING}" in links  # a backlog series
    assert marks(html, "backlog") == {PING: {_hour(): 7.0}}


def _hour() -> str:
    now = database_now()
    return now.replace(minute=0, second=0, microsecond=0).isoformat()


def test_the_overview_says_so_when_a_window_has_no_data(viewer):
    html = page(viewer, OVERVIEW)
    for chart in ("finished", "failures", "backlog", "latency"):
        [figure] = html.select("figure", data_chart=chart)
        assert figure.get("data-empty") == "true", chart
        assert not html.select("g", chart, **{"class": "jobs-bin"})
    text = viewer.get(OVERVIEW).content.decode()
    assert "No data in this window" in text and "No backlog samples in this window" in text


def test_failures_say_none_failed_rather_than_no_data(viewer):
    end([(PING, "succeeded", "")])
    html = page(viewer, OVERVIEW)
    assert html.select("figure", data_chart="failures")[0].get("data-empty") == "true"
    assert "No attempt failed in this window (1 ended)." in viewer.get(OVERVIEW).content.decode()
    assert html.select("figure", data_chart="finished")[0].get("data-empty") is None


def test_windows_choose_their_bins_and_older_hours_show_only_in_longer_windows(viewer):
    put_history(PING, "succeeded", "", 40, hours_ago=5)
    assert not marks(page(viewer, OVERVIEW), "finished")  # the hour window: not in it

    day = page(viewer, OVERVIEW, window="day")
    bins = day.select("g", "finished", **{"class": "jobs-bin"})
    assert len(bins) == 24 and all(b["data-start"].endswith(":00:00+00:00") for b in bins)
    assert sum(marks(day, "finished")["succeeded"].values()) == 40
    [selected] = day.select("a", **{"aria-current": "page"})
    assert selected["data-window"] == "day"

    week = page(viewer, OVERVIEW, window="week")
    assert len(week.select("g", "finished", **{"class": "jobs-bin"})) == 28
    assert sum(marks(week, "finished")["succeeded"].values()) == 40
    odd = page(viewer, OVERVIEW, window="year")  # unknown: the default
    assert [a["data-window"] for a in odd.select("a", **{"aria-current": "page"})] == ["hour"]


def test_a_window_past_the_retention_says_so_and_shades_what_is_gone(viewer):
    put_history(PING, "succeeded", "", 5, hours_ago=3)
    with override_settings(JOBS={"ROLLUP_RETENTION": timedelta(days=2)}):
        html = page(viewer, OVERVIEW, window="week")
        text = viewer.get(OVERVIEW, {"window": "week"}).content.decode()
    [shade] = html.select("rect", "finished", **{"class": "jobs-pruned"})
    assert int(shade["data-pruned"]) in {19, 20}  # 6-hour bins wholly older than two days
    assert "History is kept for 2d 00h" in text
    assert "History is kept" not in viewer.get(OVERVIEW, {"window": "week"}).content.decode()


def test_the_overview_reads_a_fixed_number_of_queries_whatever_the_history_holds(viewer):
    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            viewer.get(OVERVIEW, {"window": "week"})
        return len(ctx.captured_queries)

    before = queries()
    end([(PING, "succeeded", ""), (AUDIT, "failed", "rejected")])
    for hours in range(1, 30):
        put_history(f"bulk.type{hours % 7}.v1", "succeeded", "", hours, hours_ago=hours)
    rollup.record_backlog([(f"bulk.type{k}.v1", k, k, None) for k in range(12)], at=database_now())
    assert queries() == before


def test_chart_names_are_escaped(viewer):
    rollup.record_backlog([('<b>"evil"</b>', 3, 1, None)], at=database_now())
    text = viewer.get(OVERVIEW).content.decode()
    assert '<b>"evil"</b>' not in text
    assert "&lt;b&gt;&quot;evil&quot;&lt;/b&gt;" in text


def test_the_performance_page_figures_each_type(viewer):
    end(
        [
            (PING, "succeeded", ""),
            (PING, "succeeded", ""),
            (PING, "succeeded", ""),
            (PING, "failed", "handler_error"),
            (PING, "retried", "handler_error"),
            (PING, "retried", "handler_error"),
            (AUDIT, "failed", "rejected"),
        ]
    )
    html = page(viewer, PERFORMANCE)
    rows = [r["data-type"] for r in html.select("tr") if "data-type" in r]
    assert rows[:2] == [PING, AUDIT]  # by attempts, most first

    ping = _row_figures(html, PING)
    assert ping["attempts"] == "6"
    assert ping["success"] == "0.75"  # 3 / (3 + 1)
    assert ping["retries"] == "0.5"  # 2 retried / 4 ended
    assert ping["run50"] != "" and ping["wait95"] != ""
    audit = _row_figures(html, AUDIT)
    assert (audit["attempts"], audit["success"], audit["retries"]) == ("1", "0", "0")
    sparks = [s["data-values"] for s in html.select("svg", **{"class": "jobs-spark"})]
    assert any(v.split(",").count("6") == 1 for v in sparks)  # ping's attempts per minute

    monitor = reverse("admin:jobs_monitor")
    links = {a["href"] for a in html.select("a")}
    assert f"{reverse('admin:jobs_job_changelist')}?name={PING}" in links
    assert f"{monitor}?job_type={PING}&age=1h" in links


def _row_figures(html: Elements, name: str) -> dict[str, str]:
    """The data-value of each figure cell in the row of job type ``name``."""
    found: dict[str, str] = {}
    inside = False
    for tag, values, _charts in html.found:
        if tag == "tr":
            inside = values.get("data-type") == name
        elif inside and tag == "td" and "data-figure" in values:
            found[values["data-figure"]] = values["data-value"]
    return found


def test_the_performance_page_sorts_and_keeps_its_window(viewer):
    end([(PING, "succeeded", ""), (AUDIT, "failed", "rejected"), (AUDIT, "failed", "rejected")])
    put_history(PING, "succeeded", "", 10, hours_ago=4)

    def order(**query: str) -> list[str]:
        html = page(viewer, PERFORMANCE, **query)
        return [r["data-type"] for r in html.select("tr") if r.get("data-type") in {PING, AUDIT}]

    assert order() == [AUDIT, PING]  # the hour: 2 attempts against 1
    assert order(window="day") == [PING, AUDIT]  # the day: 11 against 2
    assert order(window="day", sort="-success") == [PING, AUDIT]
    assert order(window="day", sort="success") == [AUDIT, PING]
    assert order(sort="name") == [AUDIT, PING]
    html = page(viewer, PERFORMANCE, window="30d", sort="success")
    headers = {h["data-sort"]: h for h in html.select("th") if "data-sort" in h}
    assert headers["success"]["aria-sort"] == "ascending"
    assert _row_figures(html, PING)["attempts"] == "11"
    hrefs = {a["href"] for a in html.select("a") if "window=30d" in a.get("href", "")}
    assert "?window=30d&sort=-success" in hrefs  # a second click reverses it


def test_the_console_pages_need_the_jobs_view_permission():
    mail_only = client_for(operator("postmaster", "mail.view_delivery"))
    assert mail_only.get(OVERVIEW).status_code == 403
    assert mail_only.get(PERFORMANCE).status_code == 403
    changer = client_for(operator("changer", "jobs.change_job"))
    assert changer.get(PERFORMANCE).status_code == 200
