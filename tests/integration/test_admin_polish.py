"""What an operator reads all day: moments to the second with zone and age, long names cut to
their column with the whole value in the title, the app page's links once, and bulk actions
that say what they will touch first."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from jobs import queue
from jobs.models import Pause
from jobs.monitor.display import moment
from jobs.scheduler.clock import database_now
from tests.support.admin import VIEW_ALL, client_for, operator
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

LONG_TYPE = "billing.invoices.reconcile_statement_with_ledger_and_notify_accountants.v12"


@pytest.fixture
def ops():
    perms = (*VIEW_ALL, "jobs.view_process", "jobs.pause_work", "jobs.cancel_job")
    return client_for(operator("ops", *perms))


def test_a_moment_is_written_to_the_second_with_its_zone_and_age(settings):
    settings.TIME_ZONE = "Europe/Paris"
    now = database_now()
    html = moment(now - timedelta(minutes=3, seconds=5), now)
    text = re.sub(r"<[^>]+>", "", html)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d CES?T \(3 min ago\)", text)
    assert f'datetime="{(now - timedelta(minutes=3, seconds=5)).isoformat()}"' in html
    assert moment(None, now) == "—"


def test_the_jobs_list_writes_moments_and_cuts_long_names_keeping_the_link(ops):
    job = JobFactory(name=LONG_TYPE, job_id="statement-2026-11-acme", tenant="acme-europe")
    body = ops.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert f'<span class="jobs-clip" title="{LONG_TYPE}">{LONG_TYPE}</span>' in body
    change = reverse("admin:jobs_job_change", args=[job.pk])
    assert f'<a href="{change}"><span class="jobs-clip" title="statement-2026-11-acme">' in body
    created = re.search(r'<td class="field-created_at"><time [^>]*>(.*?)</time>', body)
    assert created is not None
    assert "just now" in created.group(1) or "s ago" in created.group(1)
    assert 'class="jobs-zone"' in created.group(1)
    assert "?o=" in body  # the replaced columns still sort
    detail = ops.get(change).content.decode()
    assert detail.count('class="jobs-age"') >= 1  # the job's page ages its moments too


def test_the_processes_and_pauses_lists_write_moments_with_ages(ops):
    queue.pause("job_type", LONG_TYPE, by="alice", reason="INC-7")
    pauses = ops.get(reverse("admin:jobs_pause_changelist")).content.decode()
    assert 'class="jobs-age"' in pauses and 'class="jobs-zone"' in pauses


def test_the_app_page_shows_each_link_once_and_the_new_pages(ops):
    body = ops.get(reverse("admin:app_list", args=["jobs"])).content.decode()
    main = body[body.index('id="content-main"') :]
    hrefs = re.findall(r'<a [^>]*href="([^"]+)"', main)
    listed = [href for href in hrefs if not href.endswith("/add/")]
    assert len(listed) == len(set(listed)), sorted(listed)
    for name in ("jobs_monitor", "jobs_monitor_groups", "jobs_overview"):
        assert reverse(f"admin:{name}") in listed
    assert reverse("admin:jobs_performance") in listed
    assert reverse("admin:jobs_schedules") in listed


def test_resume_selected_lists_what_it_lifts_and_what_is_over_already(ops):
    queue.pause("queue", "bulk", by="alice")
    queue.pause("tenant", "acme", by="alice")
    live, gone = list(Pause.objects.order_by("pk"))
    queue.resume("tenant", "acme")  # over before the operator's click
    data = {"action": "resume_selected", "_selected_action": [live.pk, gone.pk]}
    page = ops.post(reverse("admin:jobs_pause_changelist"), data).content.decode()
    assert "queue bulk" in page and "tenant acme" not in page
    assert "1 selected pause is over already" in page
    assert Pause.objects.count() == 1 and not LogEntry.objects.exists()  # nothing done yet
    ops.post(reverse("admin:jobs_pause_changelist"), {**data, "post": "yes"})
    assert not Pause.objects.exists()
