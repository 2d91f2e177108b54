"""In headless Chromium: the batches list and a batch's page, from a member to its successor.

With ``JOBS_UPDATE_SCREENSHOTS=1`` the test rewrites ``docs/images/batches.png``, as
``test_browser.py`` does.
"""

from __future__ import annotations

import pytest

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob, batches
from tests.support.admin import operator
from tests.support.browser import SMALL, TIMEOUT_MS, shot

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "test.noop.v1"


def seed() -> int:
    """A finished import (one line failed), one still running, one its creator left open."""
    done = batches.open(NewJob(name="demo.import_report.v1"), description="import crm.csv")
    batches.add(done, [NewJob(name=NAME, payload={"line": i}) for i in range(4)])
    batches.seal(done)
    held = queue.claim([ClaimRequest(NAME, 4)], scope=AllTenants())
    for job in held[:3]:
        queue.complete(job)
    queue.fail(held[3], code="rejected", detail="line 4: no email address")
    running = batches.open(NewJob(name="demo.import_report.v1"), description="import leads.csv")
    batches.add(running, [NewJob(name=NAME, payload={"line": i}) for i in range(250)])
    batches.seal(running)
    for job in queue.claim([ClaimRequest(NAME, 100)], scope=AllTenants()):
        queue.complete(job)
    batches.open(None, description="streaming export, chunk 3 of 10")
    return done


def test_an_operator_follows_a_batch_from_the_list_to_its_members_and_successor(
    live_server, browser
):
    done = seed()
    operator("ops", "jobs.view_job", password="correct horse")
    context = browser.new_context(viewport=SMALL)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(f"{live_server.url}/admin/login/?next=/admin/jobs/batch/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")

    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 3
    text = page.inner_text("#result_list")
    assert "4 / 4" in text and "100 / 250" in text and "0 / 0" in text
    assert "finished" in text and "running" in text and "open" in text
    assert page.evaluate(
        "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )
    shot(page, "batches.png", down_to="#result_list")

    page.click(f"#result_list a:text-is('{done}')")
    page.wait_for_url(f"**/admin/jobs/batch/{done}/change/")
    successor = batches.get(done).successor_pk
    page.click(f"a:text-is('{successor}')")
    page.wait_for_url(f"**/admin/jobs/job/{successor}/change/")
    page.go_back()
    page.click("a:text-is('in the jobs table')")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 4
    context.close()
