"""In headless Chromium: the console's remaining pages fit a laptop and a desktop screen.

The overview and performance pages (test_browser_charts.py), the schedules page
(test_browser_schedules.py) and the live lists (test_browser_live.py) are checked beside their
features; this visits the rest an operator opens: the app page, a failed job's page with its
attempts, the finished jobs list, the pause form and the confirmation pages, with the same
long names and errors, at 1280 x 800 and 1920 x 1080.
"""

from __future__ import annotations

import pytest

from jobs.models import Job
from tests.support.browser import LARGE, OVERFLOW, SMALL, seed_console

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live")]


def test_every_other_console_page_fits_without_a_horizontal_scroll(context, live_server):
    seed_console()
    failed = Job.objects.filter(state="failed").order_by("pk").first()
    queued = Job.objects.filter(state="queued").order_by("pk").first()
    assert failed is not None and queued is not None
    pages = {
        "app page": "/admin/jobs/",
        "failed job": f"/admin/jobs/job/{failed.pk}/change/",
        "finished jobs": "/admin/jobs/jobhistory/",
        "pause form": "/admin/jobs/pause/add/",
        "replay all confirmation": "/admin/jobs/job/monitor/replay/?all=1&state=failed",
        "cancel confirmation": f"/admin/jobs/job/{queued.pk}/cancel/",
    }
    page = context.new_page()
    wide, missing = [], []
    for size in (SMALL, LARGE):
        page.set_viewport_size(size)
        for name, path in pages.items():
            response = page.goto(f"{live_server.url}{path}")
            if response is None or response.status != 200:
                missing.append(f"{name}: {response and response.status}")
                continue
            page.wait_for_selector("#content")
            wide += [f"{name} at {size['width']}px: {what}" for what in page.evaluate(OVERFLOW)]
    assert not missing, missing
    assert not wide, wide
