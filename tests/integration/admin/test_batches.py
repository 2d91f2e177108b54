"""The admin's batches: counts, status, members and successor, read-only."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs import queue
from jobs.queue import AllTenants, ClaimRequest, NewJob, batches
from tests.support.admin import client_for, operator

pytestmark = pytest.mark.django_db

NAME = "test.noop.v1"


def finished_batch() -> int:
    batch_id = batches.open(NewJob(name="test.report.v1"), description="import crm.csv")
    batches.add(batch_id, [NewJob(name=NAME, payload={"i": i}) for i in range(3)])
    batches.seal(batch_id)
    first, second, third = queue.claim([ClaimRequest(NAME, 3)], scope=AllTenants())
    queue.complete(first)
    queue.complete(second)
    queue.fail(third, code="rejected", detail="no email")
    return batch_id


def test_the_list_shows_counts_and_status_and_nobody_can_edit():
    done = finished_batch()
    running = batches.open(None, description="still going")
    batches.add(running, [NewJob(name=NAME)])
    batches.seal(running)
    client = client_for(operator("viewer", "jobs.view_job"))

    page = client.get(reverse("admin:jobs_batch_changelist")).content.decode()
    assert "import crm.csv" in page and "still going" in page
    assert "3 / 3" in page and "0 / 1" in page
    finished = client.get(reverse("admin:jobs_batch_changelist") + "?status=finished")
    assert "import crm.csv" in finished.content.decode()
    assert "still going" not in finished.content.decode()

    detail = client.get(reverse("admin:jobs_batch_change", args=[done])).content.decode()
    successor = batches.get(done).successor_pk
    assert reverse("admin:jobs_job_change", args=[successor]) in detail
    assert f"?batch={done}" in detail and f"?batch_id={done}" in detail
    assert client.post(reverse("admin:jobs_batch_change", args=[done]), {}).status_code == 403


def test_the_members_link_lists_exactly_the_batch_members():
    done = finished_batch()
    other = batches.open(None)
    batches.add(other, [NewJob(name=NAME, job_id="not-a-member-of-the-first")])
    client = client_for(operator("viewer", "jobs.view_job"))
    page = client.get(reverse("admin:jobs_job_changelist") + f"?batch={done}")
    assert page.status_code == 200
    assert page.context["cl"].result_count == 3


def test_without_job_permissions_batches_are_hidden():
    finished_batch()
    client = client_for(operator("nobody"))
    assert client.get(reverse("admin:jobs_batch_changelist")).status_code == 403


def test_a_jobs_page_shows_its_batch_what_it_waits_for_and_who_waits_for_it():
    done = finished_batch()
    top = queue.enqueue(NewJob(name=NAME, job_id="top")).id
    waiting = queue.enqueue(NewJob(name="test.after.v1", after=(top,))).id
    client = client_for(operator("viewer", "jobs.view_job"))

    successor = batches.get(done).successor_pk
    page = client.get(reverse("admin:jobs_job_change", args=[successor])).content.decode()
    assert "successor of batch" in page
    member = queue.batches.failures(done)[0].id
    page = client.get(reverse("admin:jobs_job_change", args=[member])).content.decode()
    assert "member of batch" in page and "import crm.csv, 3 / 3 finished" in page
    page = client.get(reverse("admin:jobs_job_change", args=[waiting])).content.decode()
    assert f"#{top}</a> (queued)" in page and "still waiting for 1" in page
    assert "when the jobs it waits for have succeeded" in page  # its run after
    page = client.get(reverse("admin:jobs_job_change", args=[top])).content.decode()
    assert "1 jobs wait for this one" in page
    listing = client.get(reverse("admin:jobs_job_changelist")).content.decode()
    assert "waiting for 1 job" in listing
    plain = queue.enqueue(NewJob(name=NAME)).id
    page = client.get(reverse("admin:jobs_job_change", args=[plain])).content.decode()
    assert "Workflow" not in page
