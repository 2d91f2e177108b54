"""Headless Chromium for the console's browser tests: how it is launched, the window sizes
the pages must fit, docs screenshots, and the rows an operator meets.

The ``browser``, ``context`` and ``live`` fixtures built on these are in
tests/acceptance/conftest.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.db import connection

from jobs import queue
from jobs.queue import AllTenants, ClaimedJob, ClaimRequest, ProcessBeat, processes
from tests.support.factories import DeliveryFactory, JobFactory, ago

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

TIMEOUT_MS = 10_000


# Operator controls at a laptop's size; the docs' screenshots come from these runs.
SMALL = {"width": 1280, "height": 800}

DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

WORKER = "worker-1:4242:ab12"


def shot(target, name: str, *, down_to: str = "") -> None:
    """Save a docs screenshot, only when JOBS_UPDATE_SCREENSHOTS=1 (CI leaves the images alone).

    ``target`` is a page (its viewport, or from the top down to the element ``down_to``) or
    an element.
    """
    if os.environ.get("JOBS_UPDATE_SCREENSHOTS") != "1":
        return
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    path = str(DOCS_IMAGES / name)
    if down_to:
        box = target.locator(down_to).bounding_box()
        bottom = box["y"] + box["height"] + 16 + target.evaluate("window.scrollY")
        clip = {"x": 0, "y": 0, "width": SMALL["width"], "height": bottom}
        target.screenshot(path=path, full_page=True, clip=clip)
    else:
        target.screenshot(path=path)
    print(f"\nscreenshot: {path}")


def log_in(browser, live_server, username: str, to: str):
    page = browser.new_page(viewport=SMALL)
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{live_server.url}/admin/login/?next={to}")
    page.fill("#id_username", username)
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{to}")
    return page


def seed_processes() -> None:
    """Two live workers (one holding a job, one draining) and a leading scheduler."""
    common = {"host": "worker-1", "version": "0.1.0", "expires_in": 60}
    processes.register(WORKER, component="worker", pid=4242, concurrency=4, **common)
    processes.beat(ProcessBeat(WORKER, 1, False, expires_in=60))
    draining = "worker-2:4243:cd34"
    processes.register(draining, component="worker", pid=4243, concurrency=4, **common)
    processes.beat(ProcessBeat(draining, 0, True, expires_in=60))
    leader = "worker-1:4300:ef56"
    processes.register(leader, component="scheduler", pid=4300, concurrency=None, **common)
    processes.beat(ProcessBeat(leader, 0, False, leader=True, expires_in=60))


LARGE = {"width": 1920, "height": 1080}

INTERVAL = 0.3  # seconds between refreshes in these tests


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


LONG_TYPE = "billing.invoices.reconcile_statement_with_ledger_and_notify_accountants.v12"

LONG_ERROR = (
    "ConnectionError: HTTPSConnectionPool(host='ledger.internal.example.com', port=443): "
    "Max retries exceeded with url: /api/v2/statements/2026-11/reconcile?account="
    "ACME-INDUSTRIES-HOLDINGS-EUROPE-0001&include=lines,adjustments,corrections "
    "(Caused by NewConnectionError: Failed to establish a new connection: [Errno 111] "
    "Connection refused)"
)


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
