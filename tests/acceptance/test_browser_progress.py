"""A running job's progress moving on its page and in the running jobs view, in Chromium.

The renewal that carries a report is called directly here (a worker's lease keeper makes the
same call); the pages pick it up with their live refresh, without reloading.
"""

from __future__ import annotations

import pytest

from jobs import queue
from jobs.core.progress import Progress
from tests.support.browser import claim, not_reloaded, open_page
from tests.support.factories import JobFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live")]

REGION = "[data-jobs-live='progress']"


def report(job, done: int, total: int, note: str) -> None:
    renewal = queue.renew_leases([job], progress={job.claim_token: Progress(done, total, note)})
    assert not renewal.lost and not renewal.unsent


def test_progress_moves_on_the_job_page_and_in_the_running_view(context, live_server):
    JobFactory(name="jobapp.ping.v1")
    [job] = claim("jobapp.ping.v1", 1)
    report(job, 1, 4, "first file")
    detail = open_page(context, live_server, f"/admin/jobs/job/{job.id}/change/")
    running = open_page(context, live_server, "/admin/jobs/job/?state__exact=running")
    assert "1 / 4 (25%) — first file" in detail.inner_text(REGION)
    assert "25%" in running.inner_text("td.field-progress_column")

    report(job, 3, 4, "third file")

    detail.wait_for_selector(f"{REGION}:has-text('3 / 4 (75%) — third file')")
    assert detail.get_attribute(f"{REGION} progress", "value") == "3"
    running.wait_for_selector("td.field-progress_column:has-text('75%')")
    assert not_reloaded(detail) and not_reloaded(running)

    assert queue.complete(job)
    detail.wait_for_selector(f"{REGION}:has-text('the last report')")
    assert "3 / 4 (75%)" in detail.inner_text(REGION)
