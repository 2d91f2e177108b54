"""In headless Chromium: the console's pages refresh themselves, keep the operator's selection,
stop when paused, and fit a laptop's screen without a horizontal scroll.

Changes are made after a page has loaded through the queue's own API (a claimed job completed
or failed), and the test polls with a deadline until the page shows them. The page is never
reloaded: a marker set on ``window`` at load must still be there. The live interval is cut to
a fraction of a second (``JOBS["LIVE_REFRESH"]``) so that each wait is short. One browser
serves the whole module. With ``JOBS_UPDATE_SCREENSHOTS=1`` the layout test rewrites the
screenshots in ``docs/images/``, as ``test_browser.py`` does.
"""

from __future__ import annotations

import pytest

from jobs import queue
from jobs.runs import ErrorCode
from tests.support.browser import (
    LARGE,
    OVERFLOW,
    SMALL,
    claim,
    not_reloaded,
    open_page,
    seed_console,
    shot,
    wait_refreshes,
)
from tests.support.factories import JobFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live")]


def test_pages_show_work_that_finished_after_they_loaded(context, live_server):
    """The running jobs view drops a job once it completes and keeps a checked one until the
    operator lets go of it; the monitor shows a job that failed after it loaded."""
    JobFactory.create_batch(3, name="jobapp.ping.v1")
    first, second, third = claim("jobapp.ping.v1", 3)
    running = open_page(context, live_server, "/admin/jobs/job/?state__exact=running")
    monitor = open_page(context, live_server, "/admin/jobs/job/monitor/")
    assert running.locator("#result_list tbody tr").count() == 3
    assert "3 jobs" in running.inner_text("[data-jobs-live='pagination']")
    assert monitor.locator("#result_list tbody tr[data-row]").count() == 0

    box = running.locator(f"input.action-select[value='{second.id}']")
    box.check()
    assert queue.complete(first)
    running.wait_for_function(
        "() => document.querySelectorAll('#result_list tbody tr').length === 2"
    )
    assert "2 jobs" in running.inner_text("[data-jobs-live='pagination']")
    assert box.is_checked()  # the operator's selection survived the refresh
    assert running.locator(f"tr:has(input[value='{second.id}'])").get_attribute("class") == (
        "selected"
    )
    assert "1 of 2 selected" in running.inner_text(".action-counter")

    assert queue.fail(third, code=ErrorCode.HANDLER_ERROR, detail="upstream answered 503")
    monitor.wait_for_selector(f"tr[data-row='jobs.job:{third.id}']")
    assert "upstream answered 503" in monitor.inner_text(f"tr[data-row='jobs.job:{third.id}']")

    running.wait_for_selector("[data-jobs-live='pagination']:has-text('1 job')")

    # The checked job finishes: the list would drop what the operator selected, so it waits.
    assert queue.complete(second)
    wait_refreshes(running, 2)
    assert box.is_checked()
    assert "selection kept" in running.inner_text(".jobs-live-status")
    assert "1 job" in running.inner_text("[data-jobs-live='pagination']")  # held whole
    box.uncheck()
    running.wait_for_selector("[data-jobs-live='pagination']:has-text('0 jobs')")
    assert running.locator("input.action-select").count() == 0
    assert not_reloaded(running) and not_reloaded(monitor)


def test_a_paused_page_shows_nothing_new_until_resumed(context, live_server):
    """Pausing stops the fetches (another open page, still live, is the clock); resuming
    fetches at once; the choice is remembered for the next page."""
    JobFactory(name="jobapp.ping.v1", job_id="first-job")
    paused = open_page(context, live_server, "/admin/jobs/job/")
    clock = open_page(context, live_server, "/admin/jobs/job/")
    fetched: list[str] = []

    def note(request) -> None:
        if request.headers.get("x-jobs-live"):
            fetched.append(request.url)

    paused.on("request", note)
    paused.click(".jobs-live-toggle")
    assert paused.get_attribute("[data-jobs-live-root]", "data-jobs-live-state") == "paused"
    assert paused.inner_text(".jobs-live-toggle") == "Resume"
    asked = len(fetched)

    JobFactory(name="jobapp.ping.v1", job_id="made-while-paused")
    clock.wait_for_selector("#result_list [title='made-while-paused']")
    wait_refreshes(clock, 2)  # two more refreshes there: time enough for several here
    assert paused.locator("#result_list [title='made-while-paused']").count() == 0
    assert len(fetched) == asked

    paused.click(".jobs-live-toggle")
    paused.wait_for_selector("#result_list [title='made-while-paused']")
    assert not_reloaded(paused)

    paused.click(".jobs-live-toggle")  # paused again: the next page starts paused
    later = context.new_page()
    later.goto(f"{live_server.url}/admin/jobs/job/monitor/")
    later.wait_for_selector("[data-jobs-live-root][data-jobs-live-state='paused']")
    assert later.inner_text(".jobs-live-state") == "Live: paused"


PAGES = {
    "monitor": "/admin/jobs/job/monitor/",
    "failures-by-cause": "/admin/jobs/job/monitor/groups/",
    "jobs-list": "/admin/jobs/job/",
    "processes": "/admin/jobs/process/",
    "pauses": "/admin/jobs/pause/",
}


def test_the_live_pages_and_lists_fit_a_laptop_without_a_horizontal_scroll(context, live_server):
    seed_console()
    page = context.new_page()
    wide = []
    for size in (SMALL, LARGE):
        page.set_viewport_size(size)
        for name, path in PAGES.items():
            page.goto(f"{live_server.url}{path}")
            page.wait_for_selector("#content-main")
            wide += [f"{name} at {size['width']}px: {what}" for what in page.evaluate(OVERFLOW)]
            if size is SMALL:
                shot(page, f"console-{name}.png")
    assert not wide, wide
