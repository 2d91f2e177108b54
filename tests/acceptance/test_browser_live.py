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

import os

import pytest
from django.db import connection, connections

from jobs import queue
from jobs.queue import AllTenants, ClaimedJob, ClaimRequest
from jobs.runs import ErrorCode
from tests.acceptance.test_browser import (
    CHROMIUM,
    FLAGS,
    SMALL,
    TIMEOUT_MS,
    WORKER,
    seed_processes,
    shot,
)
from tests.factories import JobFactory
from tests.integration.test_admin_factories import (
    REPLAY_ALL,
    VIEW_ALL,
    DeliveryFactory,
    ago,
    operator,
)

pytestmark = pytest.mark.django_db(transaction=True)

LARGE = {"width": 1920, "height": 1080}
INTERVAL = 0.3  # seconds between refreshes in these tests


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: install it or set CHROMIUM=/path/to/chromium")
    # Playwright's sync API runs an event loop in this thread for the whole module; the ORM
    # calls of the tests and of the database fixtures are plain synchronous code beside it.
    with pytest.MonkeyPatch.context() as patch, sync_api.sync_playwright() as playwright:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield launched
        finally:
            launched.close()
            connections.close_all()  # the thread's connection while Playwright's loop ran


@pytest.fixture(autouse=True)
def live(settings):
    """A short live interval."""
    settings.JOBS = {**getattr(settings, "JOBS", {}), "LIVE_REFRESH": INTERVAL}


@pytest.fixture
def context(browser, live_server):
    """A browser context (its own cookies and localStorage) logged in as ``ops``."""
    operator(
        "ops",
        *VIEW_ALL,
        *REPLAY_ALL,
        "jobs.cancel_job",
        "jobs.change_job",
        "jobs.view_process",
        "jobs.pause_work",
        password="correct horse",
    )
    made = browser.new_context(viewport=SMALL)
    made.set_default_timeout(TIMEOUT_MS)
    page = made.new_page()
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")
    page.close()
    yield made
    made.close()


def open_page(context, live_server, path: str):
    """Open ``path`` and mark the window, so a full reload would show."""
    page = context.new_page()
    page.goto(f"{live_server.url}{path}")
    page.wait_for_selector("[data-jobs-live-root][data-jobs-live-state='on']")
    page.evaluate("window.jobsTestMarker = 'loaded once'")
    return page


def refreshes(page) -> int:
    return int(page.get_attribute("[data-jobs-live-root]", "data-jobs-live-count") or 0)


def wait_refreshes(page, more: int = 1) -> None:
    """Wait until the page has refreshed ``more`` times from now."""
    target = refreshes(page) + more
    page.wait_for_function(
        "n => Number(document.querySelector('[data-jobs-live-root]').dataset.jobsLiveCount) >= n",
        arg=target,
    )


def not_reloaded(page) -> bool:
    return page.evaluate("window.jobsTestMarker") == "loaded once"


def claim(name: str, count: int) -> list[ClaimedJob]:
    claimed = queue.claim([ClaimRequest(name, count)], scope=AllTenants(), worker="w-1:1:aa")
    assert len(claimed) == count
    return sorted(claimed, key=lambda job: job.id)


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


LONG_TYPE = "billing.invoices.reconcile_statement_with_ledger_and_notify_accountants.v12"
LONG_ERROR = (
    "ConnectionError: HTTPSConnectionPool(host='ledger.internal.example.com', port=443): "
    "Max retries exceeded with url: /api/v2/statements/2026-11/reconcile?account="
    "ACME-INDUSTRIES-HOLDINGS-EUROPE-0001&include=lines,adjustments,corrections "
    "(Caused by NewConnectionError: Failed to establish a new connection: [Errno 111] "
    "Connection refused)"
)
PAGES = {
    "monitor": "/admin/jobs/job/monitor/",
    "failures-by-cause": "/admin/jobs/job/monitor/groups/",
    "jobs-list": "/admin/jobs/job/",
    "processes": "/admin/jobs/process/",
    "pauses": "/admin/jobs/pause/",
}


# What scrolls sideways: the page, or a table cut inside its scrolling box (the admin's .results).
OVERFLOW = """() => {
    const found = [];
    const page = document.documentElement;
    if (page.scrollWidth > page.clientWidth) {
        found.push(`the page by ${page.scrollWidth - page.clientWidth}px`);
    }
    document.querySelectorAll("#content .results, #content .module, #content table").forEach(el => {
        if (el.scrollWidth > el.clientWidth + 1) {
            const name = `${el.tagName.toLowerCase()}#${el.id}.${el.className}`;
            found.push(`${name} by ${el.scrollWidth - el.clientWidth}px`);
        }
    });
    return found;
}"""


def seed_console() -> None:
    """Rows as an operator meets them: long type names, tenants and errors, in every state,
    and ids of a table that has run for years (ten digits, not the test database's few)."""
    with connection.cursor() as cur:
        cur.execute("SELECT setval(pg_get_serial_sequence('jobs_job', 'id'), 4200000000)")
    for n in range(6):
        JobFactory(
            failed=True,
            name=LONG_TYPE,
            job_id=f"statement-reconcile-acme-industries-holdings-europe-2026-11-{n:04d}",
            tenant="acme-industries-holdings-europe",
            queue="ledger-reconciliation",
            error_detail=f"Traceback (most recent call last):\n  ...\n{LONG_ERROR}",
            finished_at=ago(minutes=n + 1),
        )
    JobFactory.create_batch(3, name=LONG_TYPE, tenant="acme-industries-holdings-europe")
    JobFactory(running=True, name="jobapp.ping.v1", claimed_by=WORKER)
    DeliveryFactory(
        job_id="welcome-mail-for-a-customer-with-a-long-address@example.com",
        error_detail="550 5.1.1 The email account that you tried to reach does not exist",
        finished_at=ago(minutes=2),
    )
    queue.pause("job_type", LONG_TYPE, by="alice", reason="INC-7: the ledger is being migrated")
    queue.pause("tenant", "acme-industries-holdings-europe", by="bob", reason="customer asked")
    seed_processes()


def test_every_live_and_polished_page_fits_a_laptop_without_a_horizontal_scroll(
    context, live_server
):
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
