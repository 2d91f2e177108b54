"""The admin's operator controls: pause and resume, cancel, the attempt timeline, capacity.

Each control is refused without its permission, changes nothing on GET, refuses a POST
without its CSRF token, acts on the confirming POST with its log entries, and acts once when
the POST comes twice.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory, Pause
from jobs.queue import (
    ProcessBeat,
    history,
    processes,
)
from jobs.runs import RunState
from tests.support.admin import VIEW_ALL, client_for, operator
from tests.support.factories import JobFactory, job_with_three_attempts
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db

ADD = reverse("admin:jobs_pause_add")
PAUSES = reverse("admin:jobs_pause_changelist")
OVERVIEW = reverse("admin:jobs_overview")
JOBS = reverse("admin:jobs_job_changelist")
TYPE = "jobapp.ping.v1"


@pytest.fixture
def pauser() -> Client:
    return client_for(operator("pauser", "jobs.view_job", "jobs.pause_work"))


@pytest.fixture
def viewer() -> Client:
    return client_for(operator("viewer", "jobs.view_job", "jobs.view_pause"))


@pytest.fixture
def canceller() -> Client:
    return client_for(operator("canceller", "jobs.view_job", "jobs.cancel_job"))


def csrf_client(user: User) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def paused() -> list[tuple[str, str]]:
    return sorted(Pause.objects.values_list("kind", "value"))


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def seed_pause(kind: str = "job_type", value: str = TYPE, reason: str = "") -> Pause:
    assert queue.pause(kind, value, by="someone", reason=reason)
    return Pause.objects.get(kind=kind, value=value)


class TestPause:
    def test_get_asks_first_and_changes_nothing(self, pauser):
        page = pauser.get(ADD, {"kind": "job_type", "value": TYPE, "next": OVERVIEW})

        assert page.status_code == 200
        assert page.templates[0].name == "admin/jobs/pause/pause_confirmation.html"
        body = page.content.decode()
        assert f"Yes, pause job type {TYPE}" in body and "keeps growing" in body
        assert paused() == [] and not LogEntry.objects.exists()

    def test_the_confirming_post_pauses_once_and_records_it(self, pauser):
        data = {"kind": "job_type", "value": TYPE, "reason": "INC-7", "next": OVERVIEW}

        first = pauser.post(ADD, {**data, "post": "yes"}, follow=True)
        second = pauser.post(ADD, {**data, "post": "yes"}, follow=True)

        assert first.redirect_chain == [(OVERVIEW, 302)]
        assert paused() == [("job_type", TYPE)]
        row = Pause.objects.get()
        assert (row.paused_by, row.reason) == ("pauser", "INC-7")
        [entry] = LogEntry.objects.all()
        assert (entry.action_flag, entry.change_message) == (
            ADDITION,
            "Paused via the admin: INC-7",
        )
        assert messages_of(first) == [
            f"Paused job type {TYPE}: workers stop claiming its jobs within one poll interval."
        ]
        assert messages_of(second) == [f"job type {TYPE} was paused already: nothing changed."]

    def test_a_post_without_its_csrf_token_is_refused(self):
        client = csrf_client(operator("pauser", "jobs.pause_work"))
        data = {"kind": "queue", "value": "bulk", "post": "yes"}

        assert client.post(ADD, data).status_code == 403
        assert paused() == []

    def test_the_form_asks_for_a_kind_and_a_name_it_can_pause(self, pauser):
        form = pauser.get(ADD)
        assert form.templates[0].name == "admin/jobs/pause/pause_form.html"
        bad = pauser.get(ADD, {"kind": "planet", "value": " "})
        assert bad.templates[0].name == "admin/jobs/pause/pause_form.html"
        assert set(bad.context["form"].errors) == {"kind", "value"}
        refused = pauser.post(ADD, {"kind": "tenant", "value": "x" * 201, "post": "yes"})
        assert refused.context["form"].errors and paused() == []

    def test_an_unknown_job_type_is_named_on_the_confirmation(self, pauser):
        page = pauser.get(ADD, {"kind": "job_type", "value": "jobapp.pnig.v1"})
        assert page.context["unknown_type"] is True
        assert b"check the name" in page.content

    def test_without_pause_work_it_is_refused_and_hidden(self, viewer):
        pause = seed_pause()

        assert viewer.get(ADD, {"kind": "queue", "value": "bulk"}).status_code == 403
        assert (
            viewer.post(ADD, {"kind": "queue", "value": "bulk", "post": "yes"}).status_code == 403
        )
        resume = reverse("admin:jobs_pause_resume", args=[pause.pk])
        assert viewer.get(resume).status_code == 403
        assert viewer.post(resume, {"post": "yes"}).status_code == 403
        delete = reverse("admin:jobs_pause_delete", args=[pause.pk])
        assert viewer.post(delete, {"post": "yes"}).status_code == 403
        listing = viewer.get(PAUSES)
        assert listing.status_code == 200 and TYPE in listing.content.decode()
        assert b"jobs-resume" not in listing.content and ADD.encode() not in listing.content
        assert listing.context["cl"].model_admin.get_actions(listing.wsgi_request) == {}
        overview = viewer.get(OVERVIEW).content.decode()
        assert "button jobs-pause" not in overview and "button jobs-resume" not in overview
        assert paused() == [("job_type", TYPE)] and not LogEntry.objects.exists()

    def test_the_jobs_list_offers_to_pause_what_it_is_filtered_by(self, pauser, viewer):
        filtered = {"queue": "bulk", "tenant": "acme"}

        body = pauser.get(JOBS, filtered).content.decode()

        assert "Pause queue bulk…" in body and "Pause tenant acme…" in body
        assert "?kind=queue&amp;value=bulk&amp;next=" in body
        assert "jobs-pause-filter" not in pauser.get(JOBS).content.decode()
        assert "jobs-pause-filter" not in viewer.get(JOBS, filtered).content.decode()


class TestResume:
    def test_get_asks_first_then_the_confirming_post_resumes_once(self, pauser):
        pause = seed_pause(reason="deploy")
        url = reverse("admin:jobs_pause_resume", args=[pause.pk])

        page = pauser.get(url, {"next": OVERVIEW})
        assert page.status_code == 200 and b"Yes, resume" in page.content
        assert b"deploy" in page.content and paused() == [("job_type", TYPE)]

        first = pauser.post(url, {"post": "yes", "next": OVERVIEW}, follow=True)
        second = pauser.post(url, {"post": "yes", "next": OVERVIEW}, follow=True)

        assert paused() == []
        [entry] = LogEntry.objects.all()
        assert (entry.action_flag, entry.change_message) == (DELETION, "Resumed via the admin")
        assert messages_of(first)[0].startswith(f"Resumed job type {TYPE}.")
        assert messages_of(second) == ["Nothing to resume: that pause was over already."]

    def test_a_post_without_its_csrf_token_is_refused(self):
        pause = seed_pause()
        client = csrf_client(operator("pauser", "jobs.pause_work"))
        url = reverse("admin:jobs_pause_resume", args=[pause.pk])

        assert client.post(url, {"post": "yes"}).status_code == 403
        assert paused() == [("job_type", TYPE)]

    def test_deleting_a_pause_is_resuming_it_through_the_same_record(self, pauser):
        pause = seed_pause("tenant", "acme")
        delete = reverse("admin:jobs_pause_delete", args=[pause.pk])

        assert b"Yes, resume" in pauser.get(delete).content
        pauser.post(delete, {"post": "yes"})

        assert paused() == []
        assert LogEntry.objects.get().change_message == "Resumed via the admin"

    def test_resume_selected_asks_then_resumes_each_once(self, pauser):
        pauses = [seed_pause("queue", "bulk"), seed_pause("tenant", "acme")]
        data = {"action": "resume_selected", "_selected_action": [p.pk for p in pauses]}

        page = pauser.post(PAUSES, data)
        assert page.status_code == 200 and b"Yes, resume 2 pauses" in page.content
        assert len(paused()) == 2

        pauser.post(PAUSES, {**data, "post": "yes"})
        pauser.post(PAUSES, {**data, "post": "yes"})

        assert paused() == []
        assert LogEntry.objects.filter(action_flag=DELETION).count() == 2
        actions = pauser.get(PAUSES).context["cl"].model_admin.get_actions
        assert "delete_selected" not in actions(page.wsgi_request)

    def test_the_list_shows_each_pause_to_the_second_with_its_age(self, pauser):
        seed_pause(reason="INC-7")
        Pause.objects.update(paused_at=database_now() - timedelta(seconds=125))

        page = pauser.get(PAUSES).content.decode()

        assert "INC-7" in page and "someone" in page and "jobs-resume" in page
        assert "(2 min ago)" in page and 'class="jobs-zone"' in page


class TestOverview:
    def test_it_lists_pauses_marks_paused_types_and_offers_pause_and_resume(self, pauser):
        pause = seed_pause(reason="INC-7")
        seed_pause("tenant", "acme")
        JobFactory(name=TYPE)

        page = pauser.get(OVERVIEW)

        body = page.content.decode()
        types = {row["name"]: row for row in page.context["types"]}
        assert types[TYPE]["paused"] == pause and types["jobapp.audit.v1"]["paused"] is None
        assert f'data-type="{TYPE}" class="jobs-paused"' in body
        assert 'data-pause="tenant:acme"' in body and "INC-7" in body
        resume = reverse("admin:jobs_pause_resume", args=[pause.pk])
        assert f"{resume}?next=" in body
        assert f"{ADD}?kind=job_type&amp;value=jobapp.audit.v1" in body
        [since] = [p["since"] for p in page.context["pauses"] if p["pause"] == pause]
        assert len(since) == len("2025-01-01 00:00:00")

    def test_it_shows_live_workers_free_slots_and_draining_ones(self):
        for identity in ("a:1:aa", "b:2:bb", "c:3:cc"):
            processes.register(
                identity,
                component="worker",
                host="h",
                pid=1,
                version="1",
                expires_in=30,
                concurrency=4,
            )
        processes.beat(ProcessBeat("a:1:aa", 3, False, expires_in=30))
        processes.beat(ProcessBeat("c:3:cc", 0, True, expires_in=30))
        ops = client_for(operator("ops", "jobs.view_job", "jobs.view_process"))

        page = ops.get(OVERVIEW)

        assert tuple(page.context["capacity"]) == (3, 5, 1)
        body = page.content.decode()
        assert "<strong>3</strong> live workers" in body and "<strong>5</strong> free slots" in body
        assert reverse("admin:jobs_process_changelist") in body
        assert ops.get(reverse("admin:jobs_process_changelist")).status_code == 200


class TestCancel:
    def test_the_action_needs_cancel_job_not_change_job(self):
        changer = client_for(operator("changer", "jobs.change_job"))
        request = changer.get(JOBS).wsgi_request
        actions = changer.get(JOBS).context["cl"].model_admin.get_actions
        assert "cancel_selected" not in actions(request) and "run_now_selected" in actions(request)
        queued = JobFactory()
        changer.post(
            JOBS, {"action": "cancel_selected", "_selected_action": [queued.pk], "post": "yes"}
        )
        assert Job.objects.get(pk=queued.pk).state == RunState.QUEUED

    def test_the_action_acts_once_on_a_double_post(self, canceller):
        queued, running = JobFactory(), JobFactory(running=True)
        data = {"action": "cancel_selected", "_selected_action": [queued.pk, running.pk]}

        canceller.post(JOBS, {**data, "post": "yes"})
        again = canceller.post(JOBS, {**data, "post": "yes"}, follow=True)

        assert Job.objects.get(pk=queued.pk).state == RunState.CANCELLED
        assert Job.objects.get(pk=running.pk).cancel_requested_by == "canceller"
        assert sorted(LogEntry.objects.values_list("change_message", flat=True)) == [
            "Asked to stop (running) via the admin jobs list",
            "Cancelled via the admin jobs list",
        ]
        assert messages_of(again)[-1] == "Nothing to cancel. 2 selected jobs were not eligible."

    def test_the_action_refuses_a_post_without_its_csrf_token(self):
        client = csrf_client(operator("canceller", "jobs.view_job", "jobs.cancel_job"))
        queued = JobFactory()
        data = {"action": "cancel_selected", "_selected_action": [queued.pk], "post": "yes"}

        assert client.post(JOBS, data).status_code == 403
        assert Job.objects.get(pk=queued.pk).state == RunState.QUEUED

    def test_the_job_page_asks_then_asks_the_running_job_to_stop(self, canceller):
        job = JobFactory(running=True, claimed_by="w1:42:ab")
        change = reverse("admin:jobs_job_change", args=[job.pk])
        url = reverse("admin:jobs_job_cancel", args=[job.pk])
        assert url in canceller.get(change).content.decode()

        page = canceller.get(url)
        assert page.status_code == 200 and b"Yes, cancel this job" in page.content
        assert b"next lease renewal" in page.content and b"held by w1:42:ab" in page.content
        assert Job.objects.get(pk=job.pk).cancel_requested_at is None

        first = canceller.post(url, {"post": "yes"}, follow=True)
        second = canceller.post(url, {"post": "yes"}, follow=True)

        assert first.redirect_chain == [(change, 302)]
        row = Job.objects.get(pk=job.pk)
        assert (row.state, row.cancel_requested_by) == (RunState.RUNNING, "canceller")
        [entry] = LogEntry.objects.all()
        assert (entry.action_flag, entry.change_message) == (
            CHANGE,
            "Asked to stop (running) via the admin job page",
        )
        body = first.content.decode()
        assert 'id="cancel-requested"' in body and "Cancel requested by canceller at " in body
        # The moment with zone and age, as markup (not escaped into the text).
        notice = body[body.index('id="cancel-requested"') :].split("</p>")[0]
        assert "<time datetime=" in notice and ("(just now)" in notice or "ago)" in notice)
        assert url not in body  # nothing left to cancel
        assert messages_of(first)[0].startswith("Asked 1 running job to stop")
        assert messages_of(second)[0].startswith("1 job was left alone")

    def test_the_job_page_ends_a_queued_job_now(self, canceller):
        job = JobFactory()
        url = reverse("admin:jobs_job_cancel", args=[job.pk])
        assert b"ends cancelled now" in canceller.get(url).content

        canceller.post(url, {"post": "yes"})

        assert Job.objects.get(pk=job.pk).state == RunState.CANCELLED
        assert LogEntry.objects.get().change_message == "Cancelled via the admin job page"

    def test_the_job_page_control_is_refused_and_hidden_without_cancel_job(self):
        job = JobFactory(running=True)
        viewer = client_for(operator("viewer", "jobs.view_job"))
        url = reverse("admin:jobs_job_cancel", args=[job.pk])

        assert (
            url not in viewer.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
        )
        assert viewer.get(url).status_code == 403
        assert viewer.post(url, {"post": "yes"}).status_code == 403
        client = csrf_client(operator("canceller", "jobs.view_job", "jobs.cancel_job"))
        assert client.post(url, {"post": "yes"}).status_code == 403
        assert Job.objects.get(pk=job.pk).cancel_requested_at is None
        assert not LogEntry.objects.exists()

    def test_the_job_page_control_shows_the_job_only_to_who_may_view_it(self):
        """The confirmation shows the job's type, job_id, state and worker: like replay's, it
        needs the view permission as well as its own, for the GET and the POST alike."""
        job = JobFactory(running=True, job_id="invoice-4711", claimed_by="w1:42:ab")
        url = reverse("admin:jobs_job_cancel", args=[job.pk])
        blind = client_for(operator("blind", "jobs.cancel_job"))

        page = blind.get(url)

        assert page.status_code == 403
        assert b"invoice-4711" not in page.content and b"w1:42:ab" not in page.content
        assert blind.post(url, {"post": "yes"}).status_code == 403
        assert Job.objects.get(pk=job.pk).cancel_requested_at is None
        assert not LogEntry.objects.exists()

    def test_a_finished_job_has_nothing_to_cancel(self, canceller):
        job = JobFactory(succeeded=True)
        change = canceller.get(reverse("admin:jobs_job_change", args=[job.pk])).content
        assert b'id="cancel-job"' not in change
        page = canceller.get(reverse("admin:jobs_job_cancel", args=[job.pk]))
        assert b"Nothing to cancel" in page.content and b"confirm-cancel" not in page.content
        assert canceller.get(reverse("admin:jobs_job_cancel", args=[987654])).status_code == 404


class TestAttempts:
    def test_the_job_page_shows_every_attempt_newest_last(self):
        job = job_with_three_attempts()
        viewer = client_for(operator("viewer", "jobs.view_job"))

        page = viewer.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()

        timeline = page[page.index('id="attempt-timeline"') :]
        rows = timeline.split("<tbody data-attempt=")[1:]
        assert [row.split('"')[1] for row in rows] == ["1", "2", "3"]
        # To the second with zone and age (the instant in the <time> element).
        assert 'datetime="2025-03-04T10:00:00+00:00"' in rows[0]
        assert 'datetime="2025-03-04T10:00:01' in rows[0]
        assert '10:00:00 <span class="jobs-zone">UTC</span>' in rows[0] and "ago)" in rows[0]
        assert "1.2s" in rows[0] and "web-1:101:a1b2" in rows[0]
        assert 'jobs-badge-retry">retry<' in rows[0]
        assert "<summary>ConnectionError: upstream refused the connection</summary>" in rows[0]
        assert "<details>" in rows[0] and "billing.py" in rows[0]
        assert 'jobs-badge-lease_expired">lease_expired<' in rows[1] and "15.0s" in rows[1]
        assert 'jobs-badge-failed">failed<' in rows[2] and "350 ms" in rows[2]
        assert "ValueError: invoice 42 has no lines" in rows[2]

    def test_a_running_attempt_shows_how_long_it_has_run(self):
        job = JobFactory(running=True, started_at=database_now() - timedelta(seconds=42))
        viewer = client_for(operator("viewer", "jobs.view_job"))

        page = viewer.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()

        assert 'jobs-badge-running">running<' in page
        assert "running for 42s" in page or "running for 43s" in page

    def test_the_finished_job_page_shows_them_too(self):
        recent = database_now() - timedelta(minutes=5)  # partitions exist around now only
        job = job_with_three_attempts(key_held=False, started_at=recent, finished_at=recent)
        history.archive(now=database_now() + timedelta(minutes=2))
        assert JobHistory.objects.filter(pk=job.pk).exists()
        viewer = client_for(operator("viewer", "jobs.view_job"))

        page = viewer.get(reverse("admin:jobs_jobhistory_change", args=[job.pk])).content.decode()

        assert page.count("<tbody data-attempt=") == 3
        assert 'id="cancel-job"' not in page


def test_the_pauses_list_shows_a_throttles_end_and_not_a_throttle_that_ended(pauser):
    queue.throttle(TYPE, 120, reason="upstream said 429")
    queue.throttle("jobapp.other.v1", 60)
    Pause.objects.filter(value="jobapp.other.v1").update(
        until=database_now() - timedelta(seconds=1)
    )
    seed_pause("queue", "held")

    page = pauser.get(PAUSES).content.decode()

    assert TYPE in page and "upstream said 429" in page and "in 1 min" in page
    assert "jobapp.other.v1" not in page
    assert "when resumed" in page  # the operator's pause of the queue


NAME = "test.flow.v1"


@pytest.mark.django_db
def test_the_pauses_page_does_not_list_a_throttle_that_has_ended(client):
    user = get_user_model().objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    queue.throttle(NAME, 0.05, reason="upstream said 429")
    wait_for(lambda: not queue.paused(), timeout=5, what="the throttle ended")

    page = client.get(reverse("admin:jobs_pause_changelist"))

    assert page.status_code == 200
    assert NAME not in page.content.decode()


LONG_TYPE = "billing.invoices.reconcile_statement_with_ledger_and_notify_accountants.v12"


@pytest.fixture
def ops():
    perms = (*VIEW_ALL, "jobs.view_process", "jobs.pause_work", "jobs.cancel_job")
    return client_for(operator("ops", *perms))


def test_the_processes_and_pauses_lists_write_moments_with_ages(ops):
    queue.pause("job_type", LONG_TYPE, by="alice", reason="INC-7")
    pauses = ops.get(reverse("admin:jobs_pause_changelist")).content.decode()
    assert 'class="jobs-age"' in pauses and 'class="jobs-zone"' in pauses


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
