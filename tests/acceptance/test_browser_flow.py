"""In headless Chromium: the flow-control page with every kind of limit in force, at a laptop's
and a desktop's size; a freed place shows without a navigation; a tenant's weight is changed
from the page.

The limits are put in force through the queue with the page's own test registry (the
integration tests' :func:`~tests.integration.test_admin_flow.seed_limits_in_force`); the live
server runs in this process, so it sees that registry. With ``JOBS_UPDATE_SCREENSHOTS=1`` the
test rewrites ``docs/images/flow-control.png``, as ``test_browser.py`` does.
"""

from __future__ import annotations

import pytest
from django.contrib.admin.models import CHANGE, LogEntry

from jobs import queue
from jobs.admin import flow as flow_page
from jobs.models import TenantWeight
from tests.support.admin import operator
from tests.support.browser import INTERVAL, LARGE, SMALL, TIMEOUT_MS, shot
from tests.support.flow import (
    FAIR,
    GATED,
    PER_TENANT,
    PLAIN,
    RATED,
    enqueue,
    flow_registry,
    seed_limits_in_force,
)

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = "/admin/jobs/job/flow/"


def no_horizontal_scroll(page) -> bool:
    return page.evaluate(
        "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )


def test_an_operator_reads_each_limit_sees_a_place_free_and_changes_a_weight(
    live_server, browser, monkeypatch, settings
):
    settings.JOBS = {**getattr(settings, "JOBS", {}), "LIVE_REFRESH": INTERVAL}
    registry = flow_registry()
    monkeypatch.setattr(flow_page, "get_registry", lambda: registry)
    operator(
        "ops",
        "jobs.view_job",
        "jobs.view_tenantweight",
        "jobs.change_tenantweight",
        password="correct horse",
    )
    running = seed_limits_in_force(registry)
    # Long values must wrap or be cut to their column, not widen the page.
    queue.throttle(PLAIN, 900, reason="throttled by job plain-8: " + "upstream said slow down " * 7)
    enqueue(FAIR, 1, "tenant-with-a-name-as-long-as-a-tenant-may-be-" + "x" * 17)

    context = browser.new_context(viewport=SMALL)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(f"{live_server.url}/admin/login/?next={PAGE}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#flow-types")

    def row(name: str):
        return page.locator(f"#flow-types tr[data-type='{name}']")

    assert row(GATED).get_attribute("data-limiting") == "global"
    assert "2 / 2" in row(GATED).locator(".jobs-flow-running").inner_text()
    assert "rate limit: no token" in row(RATED).inner_text()
    assert row(PER_TENANT).get_attribute("data-limiting") == "tenant"
    assert "upstream said slow down" in row(PLAIN).locator(".jobs-flow-throttle").inner_text()
    assert "(in 14 min)" in row(PLAIN).locator(".jobs-flow-throttle").inner_text()
    assert row(FAIR).locator("[data-why='']").inner_text() == "no"
    fair = page.locator(f"[data-tenants-of='{FAIR}']")
    share = fair.locator("tr[data-tenant='acme']").get_attribute("data-share")
    assert float(share) == pytest.approx(3 / 5)  # beside bolt and the long-named tenant
    assert no_horizontal_scroll(page)
    shot(page, "flow-control.png", down_to="#flow-help")

    page.set_viewport_size(LARGE)
    assert no_horizontal_scroll(page)
    page.set_viewport_size(SMALL)

    # A gated job ends through the queue: the page shows the free place without a navigation.
    page.evaluate("window.jobsTestMarker = 'loaded once'")
    assert queue.complete(running[GATED][0])
    page.wait_for_selector(f"#flow-types tr[data-type='{GATED}'][data-running='1']")
    assert row(GATED).get_attribute("data-limiting") == ""
    assert page.evaluate("window.jobsTestMarker") == "loaded once"

    # Bolt has no weight row yet: its weight links to the add form, prefilled.
    fair.locator("tr[data-tenant='bolt'] a.jobs-weight-edit").click()
    page.wait_for_selector("#tenantweight_form")
    assert page.input_value("#id_tenant") == "bolt"
    page.fill("#id_weight", "3")
    page.click("input[name=_save]")
    page.wait_for_selector(".messagelist")
    assert TenantWeight.objects.get(tenant="bolt").weight == 3

    page.goto(f"{live_server.url}{PAGE}")
    fair = page.locator(f"[data-tenants-of='{FAIR}']")
    assert (
        fair.locator("tr[data-tenant='bolt']").get_attribute("data-share") == "0.42857142857142855"
    )
    fair.locator("tr[data-tenant='acme'] a.jobs-weight-edit").click()
    page.wait_for_selector("#tenantweight_form")
    page.fill("#id_weight", "1")
    page.click("input[name=_save]")
    page.wait_for_selector(".messagelist")
    entry = LogEntry.objects.filter(action_flag=CHANGE).get()
    assert entry.change_message == "Changed weight from 3 to 1 via the admin"
    assert entry.user.username == "ops"
    assert no_horizontal_scroll(page)
    context.close()
