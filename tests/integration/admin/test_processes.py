"""The processes admin page (jobs.admin.processes): read-only, states by the database clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from jobs.db.clock import database_now
from jobs.models import Job, Process
from jobs.queue import ProcessBeat, processes
from tests.support.process_rows import claim_for, register, shift

pytestmark = pytest.mark.django_db(transaction=True)


class TestAdmin:
    @pytest.fixture
    def viewer(self, client):
        user = User.objects.create_user("viewer", password="pw", is_staff=True)
        user.user_permissions.add(Permission.objects.get(codename="view_process"))
        client.force_login(user)
        return client

    def test_the_list_shows_state_capacity_and_last_seen_to_the_second(self, viewer):
        register("w1:1:aa", concurrency=4)
        register("gone:2:bb", concurrency=4)
        shift("gone:2:bb", expires_at=20, last_seen_at=20)
        processes.beat(ProcessBeat("w1:1:aa", 1, False, expires_in=10))

        page = viewer.get(reverse("admin:jobs_process_changelist")).content.decode()

        assert "w1:1:aa" in page and "gone:2:bb" in page
        assert 'class="jobs-process-ready"' in page and 'class="jobs-process-gone"' in page
        assert "(20 s ago)" in page or "(21 s ago)" in page  # by PostgreSQL's clock
        gone_only = viewer.get(reverse("admin:jobs_process_changelist") + "?state=gone")
        assert "w1:1:aa" not in gone_only.content.decode()

    def test_the_change_page_lists_the_held_jobs_with_their_elapsed_time(self, viewer):
        User.objects.get(username="viewer").user_permissions.add(
            Permission.objects.get(codename="view_job")
        )
        register("w1:1:aa")
        [job] = claim_for("w1:1:aa")
        Job.objects.filter(pk=job.id).update(started_at=database_now() - timedelta(seconds=125))
        url = reverse("admin:jobs_process_change", args=["w1:1:aa"])

        page = viewer.get(url).content.decode()

        assert reverse("admin:jobs_job_change", args=[job.id]) in page
        assert "2m 05s" in page or "2m 06s" in page

    def test_the_held_jobs_show_only_to_who_may_view_jobs(self, viewer):
        """The process is the viewer's to see; the jobs it holds (job_id, type, tenant,
        progress) are shown only to users who may view jobs."""
        register("w1:1:aa")
        [job] = claim_for("w1:1:aa")
        url = reverse("admin:jobs_process_change", args=["w1:1:aa"])

        page = viewer.get(url)

        assert page.status_code == 200 and b"w1:1:aa" in page.content
        held = Job.objects.get(pk=job.id)
        assert held.job_id.encode() not in page.content
        assert reverse("admin:jobs_job_change", args=[job.id]).encode() not in page.content
        assert b'class="jobs-held"' not in page.content

    def test_no_add_change_or_delete_only_view(self, viewer):
        register("w1:1:aa")
        assert viewer.get(reverse("admin:jobs_process_add")).status_code == 403
        delete = reverse("admin:jobs_process_delete", args=["w1:1:aa"])
        assert viewer.post(delete, {"post": "yes"}).status_code == 403
        change = reverse("admin:jobs_process_change", args=["w1:1:aa"])
        assert viewer.post(change, {"identity": "x"}).status_code == 403
        assert Process.objects.filter(identity="w1:1:aa").exists()

    def test_without_the_view_permission_the_page_is_refused(self, client):
        user = User.objects.create_user("nobody", password="pw", is_staff=True)
        client.force_login(user)
        assert client.get(reverse("admin:jobs_process_changelist")).status_code == 403
