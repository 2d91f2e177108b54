"""The admin's "Finished jobs": the history table, readable as the jobs list, replayable."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

from jobs.control.tables import RunTable
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory
from jobs.queue import history
from tests.support.admin import client_for, operator
from tests.support.history import MINUTE, finish, job

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:jobs_jobhistory_changelist"


def archived(state: str = "failed") -> int:
    (pk,) = finish(job(), state=state)
    history.archive(now=database_now() + timedelta(minutes=2))
    assert JobHistory.objects.filter(pk=pk).exists()
    return pk


def test_whoever_may_view_jobs_sees_finished_jobs_read_only():
    pk = archived()
    viewer = client_for(operator("viewer", "jobs.view_job"))

    page = viewer.get(reverse(CHANGELIST), {"state": "failed"})

    assert page.status_code == 200
    assert [row.pk for row in page.context["cl"].result_list] == [pk]
    detail = viewer.get(reverse("admin:jobs_jobhistory_change", args=[pk]))
    assert detail.status_code == 200
    assert b"boom" in detail.content  # the error detail
    assert b'name="_save"' not in detail.content


def test_someone_without_jobs_permissions_does_not():
    archived()
    stranger = client_for(operator("stranger"))
    assert stranger.get(reverse(CHANGELIST)).status_code == 403


def test_a_finished_job_replays_from_history_through_the_monitor_confirmation():
    pk = archived()
    ops = operator("alice", "jobs.view_job", "jobs.replay_job")
    client = client_for(ops)
    token = f"jobs.jobhistory:{pk}"

    asked = client.get(reverse("admin:jobs_monitor_replay"), {"rows": token})
    assert asked.status_code == 200 and not Job.objects.filter(pk=pk).exists()

    done = client.post(
        reverse("admin:jobs_monitor_replay"),
        {"rows": token, "confirm": "yes", "next": reverse(CHANGELIST)},
    )

    assert done.status_code == 302
    assert Job.objects.get(pk=pk).state == "queued"
    assert not JobHistory.objects.filter(pk=pk).exists()
    assert LogEntry.objects.filter(user=ops).exists()  # who replayed it is recorded


def test_the_overview_counts_finished_jobs_in_the_history_too():
    from jobs.admin.overview import overview_data

    archived("succeeded")
    pk = archived("failed")

    data = overview_data()

    states = {state["value"]: state for state in data["states"]}
    assert states["succeeded"]["total"] == "1" and states["failed"]["total"] == "1"
    assert [cell["text"] for cell in states["failed"]["cells"]] == ["0", "1"]
    (row,) = [t for t in data["types"] if t["name"] == JobHistory.objects.get(pk=pk).name]
    assert row["failed"] == "1"  # awaiting replay: counted exactly, wherever it is


@pytest.mark.django_db
def test_history_is_not_readable_with_unrelated_jobs_permissions():
    """A staff user with only TenantOverride permissions sees no finished jobs."""
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + MINUTE)
    user = operator("tenants", "jobs.view_tenantoverride", "jobs.change_tenantoverride")
    client = client_for(user)
    assert client.get(reverse("admin:jobs_jobhistory_changelist")).status_code == 403
    assert client.get(reverse("admin:jobs_jobhistory_change", args=[pk])).status_code == 403
    assert not RunTable(JobHistory).can_replay(user)
