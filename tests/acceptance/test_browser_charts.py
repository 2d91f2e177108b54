"""The console's charts in headless Chromium: the overview and the performance page hold the
numbers of the outcomes written, fit 1280 and 1920 px without a horizontal scroll, and the
overview's live refresh shows a job finished after the page loaded, without a navigation.

One browser for the module and few page loads: the suite's time budget is tight. With
``JOBS_UPDATE_SCREENSHOTS=1`` it rewrites docs/images/overview.png and performance.png.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from jobs import queue
from jobs.db.clock import database_now
from jobs.queue import AllTenants, ClaimRequest, rollup
from tests.support.admin import operator
from tests.support.browser import LARGE, TIMEOUT_MS, log_in, shot
from tests.support.factories import JobFactory
from tests.support.rollup import end, put_history

pytestmark = pytest.mark.django_db(transaction=True)

PING, AUDIT, MAIL = "jobapp.ping.v1", "jobapp.audit.v1", "mail.deliver.v1"
# The numbers of each mark of a chart, summed per series, read from the data attributes.
SERIES_TOTALS = """chart => {
    const totals = {};
    for (const mark of document.querySelectorAll(`[data-chart="${chart}"] .jobs-mark`)) {
        const key = mark.dataset.series;
        totals[key] = (totals[key] || 0) + Number(mark.dataset.value);
    }
    return totals;
}"""
NO_SIDEWAYS_SCROLL = (
    "() => document.documentElement.scrollWidth <= document.documentElement.clientWidth"
)


def seed_history() -> None:
    """Half an hour of earlier minutes (placed in the past by hand), a backlog sampled each
    minute, and this minute's outcomes written through the queue."""
    now = database_now()
    for minute in range(1, 31):
        put_history(
            PING,
            "succeeded",
            "",
            20 + (minute * 7) % 15,
            minutes_ago=minute,
            runs=(0.05,) * 10 + (0.4,),
            waits=(0.02,) * 10 + (0.9 + minute / 30,),
            now=now,
        )
        put_history(
            AUDIT, "succeeded", "", 6, minutes_ago=minute, runs=(1.2,), waits=(0.3,), now=now
        )
        if minute % 4 == 0:
            put_history(PING, "failed", "handler_error", 2, minutes_ago=minute, now=now)
            put_history(PING, "retried", "lease_expired", 1, minutes_ago=minute, now=now)
        if minute % 9 == 0:
            put_history(MAIL, "failed", "rejected", 1, minutes_ago=minute, now=now)
    for minute in range(0, 31):
        rollup.record_backlog(
            [
                (PING, 40 + (30 - minute) * 3, 12, 4.0),
                (AUDIT, 10 + minute % 5, 2, 1.0),
                (MAIL, 3, 0, None),
            ],
            at=now - timedelta(minutes=minute),
        )
    end(
        [
            (PING, "succeeded", ""),
            (PING, "succeeded", ""),
            (PING, "succeeded", ""),
            (PING, "failed", "handler_error"),
            (AUDIT, "retried", "handler_error"),
        ]
    )


def test_the_overview_charts_hold_the_numbers_and_refresh_live(live_server, browser, settings):
    settings.JOBS = {**settings.JOBS, "LIVE_REFRESH": timedelta(seconds=1)}
    operator("ops", "jobs.view_job", "jobs.view_process", password="correct horse")
    seed_history()
    page = log_in(browser, live_server, "ops", "/admin/jobs/job/overview/")

    finished = page.evaluate(SERIES_TOTALS, "finished")
    earlier = sum(20 + (m * 7) % 15 for m in range(1, 31))
    assert finished == {
        "succeeded": earlier + 30 * 6 + 3,
        "failed": 7 * 2 + 1 + 3,  # ping, this minute's ping, mail
        "retried": 7 + 1,
    }
    assert page.evaluate(SERIES_TOTALS, "failures") == {"handler_error": 15, "rejected": 3}
    assert page.locator('[data-chart="backlog"] .jobs-mark').count() == 3 * 31
    latest = page.locator(f'[data-chart="backlog"] .jobs-mark[data-series="{PING}"]').last
    assert latest.get_attribute("data-value") == "130"
    assert page.locator('[data-chart="latency"] .jobs-mark[data-series="p95"]').count() == 31
    assert page.locator('[data-chart="failures"] li[data-series="handler_error"] a').count() == 1
    assert page.evaluate(NO_SIDEWAYS_SCROLL)
    shot(page, "overview.png", down_to="#charts-help")

    # Finished after the page loaded: the chart shows it without a navigation.
    page.evaluate("() => { window.jobsMarker = 'still here'; }")
    refreshes = int(page.locator("[data-jobs-live-root]").get_attribute("data-jobs-live-count"))
    JobFactory(name=PING)
    [job] = queue.claim([ClaimRequest(PING, 1)], scope=AllTenants())
    assert queue.complete(job)
    page.wait_for_function(
        f"() => ({SERIES_TOTALS})('finished').succeeded === {finished['succeeded'] + 1}",
        timeout=TIMEOUT_MS,
    )
    assert page.evaluate("() => window.jobsMarker") == "still here"
    count = page.locator("[data-jobs-live-root]").get_attribute("data-jobs-live-count")
    assert int(count) > refreshes

    page.set_viewport_size(LARGE)
    assert page.evaluate(NO_SIDEWAYS_SCROLL)

    page.click('#chart-windows a[data-window="day"]')
    page.wait_for_url("**window=day**")
    assert page.locator('[data-chart="finished"] .jobs-bin').count() == 24
    assert page.evaluate(SERIES_TOTALS, "finished")["succeeded"] == finished["succeeded"] + 1


def test_the_performance_page_figures_each_type(live_server, browser):
    operator("ops", "jobs.view_job", password="correct horse")
    seed_history()
    page = log_in(browser, live_server, "ops", "/admin/jobs/job/performance/")

    order = page.eval_on_selector_all(
        "#performance tbody tr", "rows => rows.map(r => r.dataset.type)"
    )
    assert order[:3] == [PING, AUDIT, MAIL]  # most attempts first

    def figure(name: str, key: str) -> str:
        cell = page.locator(f'#performance tr[data-type="{name}"] td[data-figure="{key}"]')
        return cell.get_attribute("data-value")

    ping_ok = sum(20 + (m * 7) % 15 for m in range(1, 31)) + 3
    ping_failed, ping_retried = 7 * 2 + 1, 7
    assert figure(PING, "attempts") == str(ping_ok + ping_failed + ping_retried)
    rate = float(figure(PING, "success"))
    assert rate == pytest.approx(ping_ok / (ping_ok + ping_failed), abs=1e-5)
    assert float(figure(PING, "retries")) == pytest.approx(
        ping_retried / (ping_ok + ping_failed), abs=1e-5
    )
    assert float(figure(AUDIT, "run50")) == pytest.approx(1.2, rel=0.25)
    assert figure(MAIL, "success") == "0"
    sparks = page.locator(f'#performance tr[data-type="{PING}"] svg.jobs-spark')
    assert sparks.count() == 6
    assert page.evaluate(NO_SIDEWAYS_SCROLL)
    shot(page, "performance.png", down_to="#performance")

    page.set_viewport_size(LARGE)
    assert page.evaluate(NO_SIDEWAYS_SCROLL)
    page.click('#performance th[data-sort="success"] a')
    page.wait_for_url("**sort=-success**")
    order = page.eval_on_selector_all(
        "#performance tbody tr", "rows => rows.map(r => r.dataset.type)"
    )
    assert order.index(AUDIT) < order.index(PING) < order.index(MAIL)
