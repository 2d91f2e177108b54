"""End to end in headless Chromium: an operator finds a failed job in the monitor, replays it,
and follows a job to the run row it drives and back.

Drives the real admin on a live server with Playwright and Debian's Chromium
(``scripts/test`` installs it when it can). Saves ``tests/artifacts/monitor.png``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connections

from jobs.models import Job
from jobs.runs import RunState
from tests.factories import JobFactory
from tests.integration.test_admin_factories import (
    REPLAY_ALL,
    VIEW_ALL,
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    ago,
    operator,
)
from tests.runapp.models import Delivery as RunDelivery

pytestmark = pytest.mark.django_db(transaction=True)

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
ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "monitor.png"
TIMEOUT_MS = 10_000


@pytest.fixture
def chromium():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: scripts/test installs Debian's chromium when run as "
            f"root with apt-get; elsewhere install it or set CHROMIUM=/path/to/chromium"
        )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()
            # While Playwright's loop runs, Django hands this thread a separate connection
            # (asgiref sees an event loop); close it here, or it outlives the test database.
            connections.close_all()


def test_an_operator_replays_a_failed_job_from_the_monitor(live_server, chromium, monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the ORM calls here are plain
    # synchronous test code, not code running inside that loop.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator("ops", *VIEW_ALL, *REPLAY_ALL, password="correct horse")
    job = JobFactory(failed=True, job_id="invoice-42", finished_at=ago(minutes=3))
    JobFactory(failed=True, job_id="report-7", finished_at=ago(minutes=9))
    DeliveryFactory(job_id="welcome-ann", finished_at=ago(minutes=1))
    DeadLetterFactory(finished_at=ago(minutes=5))
    CurationRunFactory(finished_at=ago(minutes=7))
    page = chromium.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)

    page.goto(f"{live_server.url}/admin/login/?next=/admin/jobs/job/monitor/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 5  # four tables merged

    page.click("#changelist-filter a:text-is('jobs.job')")
    page.wait_for_url("**module=jobs.job**")
    assert page.locator("#result_list tbody tr").count() == 2
    row = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    row.locator("a.jobs-replay").click()

    page.wait_for_selector("#confirm-replay")
    assert "invoice-42" in page.inner_text("#content-main")
    page.click("#confirm-replay")

    page.wait_for_selector(".messagelist")
    assert "Replayed 1 row (1 jobs.job)." in page.inner_text(".messagelist")
    assert page.locator(f"tr[data-row='jobs.job:{job.pk}']").count() == 0  # not failed now
    page.click("#changelist-filter a:text-is('Queued')")
    page.wait_for_url("**state=queued**")
    queued = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    assert queued.locator("td.jobs-state").inner_text() == "queued"
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACT), full_page=True)
    print(f"\nscreenshot: {ARTIFACT}")

    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.replayed_by) == (RunState.QUEUED, "ops")
    assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1


def test_an_operator_reads_a_job_and_its_run_row_as_one_failure(live_server, chromium, monkeypatch):
    """The monitor shows a bound job and its run row on one line; their pages link each way."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator("ops", "jobs.view_job", "runapp.view_delivery", password="correct horse")
    row = RunDelivery.objects.create(
        job_id="welcome-bob", state=RunState.FAILED, finished_at=ago(minutes=2)
    )
    RunDelivery.objects.filter(pk=row.pk).update(created_at=ago(minutes=3))
    job = JobFactory(
        failed=True,
        name="runapp.deliver.v1",
        payload={"run_id": row.pk},
        finished_at=ago(minutes=2),
    )
    page = chromium.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)

    page.goto(f"{live_server.url}/admin/login/?next=/admin/jobs/job/monitor/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 1  # one failure, one line
    line = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    assert "runapp.delivery: 0" in page.inner_text(".jobs-summary")
    assert page.locator(".jobs-folded").count() == 1

    line.locator(f".jobs-link a:text-is('runapp.delivery #{row.pk}')").click()
    page.wait_for_url(f"**/admin/runapp/delivery/{row.pk}/change/")
    assert "This row is driven by job" in page.inner_text("#linked-work")

    page.click(f"#linked-work a:text-is('jobs.job #{job.pk}')")
    page.wait_for_url(f"**/admin/jobs/job/{job.pk}/change/")
    assert f"runapp.delivery #{row.pk}" in page.inner_text("#linked-work")
