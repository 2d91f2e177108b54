"""In headless Chromium: the schedules page at a laptop's and a desktop's size, run now through
its confirmation, and pause.

Slots are recorded by driving the scheduler's tick directly at each slot's time, as the
scheduler's own tests do. One browser serves the module. With ``JOBS_UPDATE_SCREENSHOTS=1`` the
test rewrites ``docs/images/schedules.png``, as ``test_browser.py`` does.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.test import override_settings

from jobs import queue
from jobs.catalogue.schedules import Schedule, get_schedules
from jobs.db.clock import database_now
from jobs.models import Job, ScheduleSlot
from jobs.runs import ErrorCode, RunState
from jobs.scheduler.cron import CronService
from tests.support.admin import operator
from tests.support.browser import LARGE, SMALL, TIMEOUT_MS, shot
from tests.support.polling import clear_of_the_next_minute

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = "/admin/jobs/job/schedules/"
SCHEDULES = {
    "minutely-ping": {
        "cron": "* * * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "tick"},
        "misfire": "all",
        "tenant": "acme",
    },
    "invoice-run": {
        "cron": "*/5 * * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "invoices"},
    },
    "nightly-report": {
        "cron": "30 2 * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "nightly"},
        "misfire": "once",
        "timezone": "Europe/Berlin",
    },
}


def fire(schedule: Schedule, back: int, *, now: datetime, gap: bool = False) -> None:
    """Tick the schedule at each of its last ``back`` slots; with ``gap``, the middle ones are
    missed (no tick), so the misfire policy records them."""
    due = []
    walk = now - timedelta(minutes=5 * back + 1)
    while (walk := schedule.next_slot(walk)) <= now:
        due.append(walk)
    due = due[-back:]
    if gap:
        due = [due[0], due[-1]]
    service = CronService([schedule], identity="scheduler-1:4300:ef56")
    for moment in due:
        service.run_once(moment + timedelta(seconds=2))


def no_horizontal_scroll(page) -> bool:
    return page.evaluate(
        "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )


@override_settings(JOBS={"SCHEDULES": SCHEDULES})
def test_an_operator_reads_the_schedules_runs_one_now_and_pauses_one(live_server, browser):
    operator(
        "ops",
        "jobs.view_job",
        "jobs.run_schedule",
        "jobs.pause_work",
        password="correct horse",
    )
    clear_of_the_next_minute(25)  # the minutely schedule stays "on time" while the page is read
    now = database_now()
    configured = {s.name: s for s in get_schedules()}
    fire(configured["minutely-ping"], 4, now=now)
    fire(configured["invoice-run"], 4, now=now, gap=True)
    # The invoice run's last job failed.
    last = ScheduleSlot.objects.filter(schedule="invoice-run", kind="on_time").latest("slot")
    Job.objects.filter(pk=last.job_pk).update(
        state=RunState.FAILED, last_error=ErrorCode.HANDLER_ERROR, finished_at=now
    )
    queue.pause("schedule", "nightly-report", by="alice", reason="INC-12: report DB migration")

    context = browser.new_context(viewport=SMALL)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.goto(f"{live_server.url}/admin/login/?next={PAGE}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#schedules-list")

    ping = page.locator("tr[data-schedule='minutely-ping']")
    assert "* * * * *" in ping.locator(".jobs-cron").inner_text()
    assert ping.locator(".jobs-outcome .jobs-badge").inner_text() == "queued"
    assert ping.locator(".jobs-schedule-state").inner_text() == "on time"
    invoice = page.locator("tr[data-schedule='invoice-run']")
    assert invoice.locator(".jobs-outcome .jobs-badge").inner_text() == "failed"
    nightly = page.locator("tr[data-schedule='nightly-report']")
    assert "Europe/Berlin" in nightly.inner_text() and "never fired" in nightly.inner_text()
    assert "by alice: INC-12" in nightly.locator(".jobs-schedule-state").inner_text()
    kinds = page.locator("#slots-list tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.kind)"
    )
    assert kinds.count("skipped") == 1 and kinds.count("on_time") == 6
    assert no_horizontal_scroll(page)
    shot(page, "schedules.png", down_to="#slots-list")

    page.set_viewport_size(LARGE)
    assert no_horizontal_scroll(page)
    page.set_viewport_size(SMALL)

    ping.locator("a.jobs-run").click()
    page.wait_for_selector("#confirm-run")
    assert "It is not a slot" in page.inner_text("#run-effect")
    assert not Job.objects.filter(job_id__startswith="run:").exists()  # asking changes nothing
    page.click("#confirm-run")
    page.wait_for_selector(".messagelist")
    assert "Enqueued one extra job of schedule minutely-ping" in page.inner_text(".messagelist")
    extra = Job.objects.get(job_id__startswith="run:minutely-ping:")
    assert extra.tenant == "acme"
    assert ScheduleSlot.objects.filter(schedule="minutely-ping").count() == 4  # no slot
    assert LogEntry.objects.get().user.username == "ops"

    invoice.locator("a.jobs-pause").click()
    page.wait_for_selector("#confirm-pause")
    page.fill("#id_reason", "month-end freeze")
    page.click("#confirm-pause")
    page.wait_for_selector(".messagelist")
    assert "paused" in invoice.locator(".jobs-schedule-state").inner_text()
    assert no_horizontal_scroll(page)
    context.close()
