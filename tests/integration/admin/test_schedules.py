"""The admin's schedules page: every schedule, its last slot's job, run now, pause and resume.

The scheduler's tick is driven directly (``CronService.run_once(now)``), as the scheduler's own
tests do; times are PostgreSQL's. Each control is refused without its permission, changes
nothing on GET, refuses a POST without its CSRF token and acts once on the confirming POST.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from io import StringIO
from zoneinfo import ZoneInfo

import pytest
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse

from jobs import queue
from jobs.catalogue import schedules as schedules_module
from jobs.catalogue import timing
from jobs.catalogue.schedules import get_schedules
from jobs.control import schedules as control
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory, Pause, ScheduleSlot, SlotKind
from jobs.queue import history
from jobs.scheduler import pausing
from jobs.scheduler.cron import CronService
from jobs.scheduler.reporting import status
from tests.support.admin import client_for, operator
from tests.support.history import finish, job

pytestmark = pytest.mark.django_db

SCHEDULES = {
    "minutely": {
        "cron": "* * * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "tick"},
        "misfire": "all",
        "tenant": "acme",
    },
    "nightly": {
        "cron": "0 3 * * *",
        "job": "jobapp.ping.v1",
        "payload": {"message": "nightly"},
        "misfire": "once",
        "timezone": "Europe/Berlin",
    },
}
PAGE = reverse("admin:jobs_schedules")
RUN = reverse("admin:jobs_schedule_run", args=["minutely"])
PAUSE = reverse("admin:jobs_schedule_pause", args=["minutely"])
RESUME = reverse("admin:jobs_schedule_resume", args=["minutely"])
ALL = ("jobs.view_job", "jobs.run_schedule", "jobs.pause_work")


@pytest.fixture(autouse=True)
def configured():
    with override_settings(JOBS={"SCHEDULES": SCHEDULES}):
        yield


@pytest.fixture
def ops() -> Client:
    return client_for(operator("ops", *ALL))


def tick(now: datetime):
    """One scheduler tick of this file's schedules (the example apps declare their own)."""
    mine = [s for s in get_schedules() if s.name in SCHEDULES]
    return CronService(mine, identity="test-scheduler").run_once(now)


def slots(name: str = "minutely") -> list[tuple]:
    return list(
        ScheduleSlot.objects.filter(schedule=name)
        .order_by("slot")
        .values_list("slot", "kind", "missed_from")
    )


def minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def row_of(page, name: str) -> dict:
    return next(item for item in page.context["schedules"] if item["status"].name == name)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def csrf_client(user: User) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


class TestPage:
    def test_every_schedule_with_its_timing_last_slot_and_next(self, ops):
        now = database_now()
        tick(now)
        page = ops.get(PAGE)

        assert page.status_code == 200
        minutely, nightly = row_of(page, "minutely"), row_of(page, "nightly")
        names = [item["status"].name for item in page.context["schedules"]]
        assert {"minutely", "nightly"} <= set(names) and names == sorted(names)
        s = minutely["status"]
        assert (s.cron, s.timezone, s.misfire, s.paused, s.overdue) == (
            "* * * * *",
            "UTC",
            "all",
            False,
            False,
        )
        assert s.last_fired_slot == minute(now)
        assert s.next_due == minute(now) + timedelta(minutes=1)
        fired = Job.objects.get(job_id=f"cron:minutely:{minute(now):%Y-%m-%dT%H:%M:%SZ}")
        assert minutely["outcome"]["state"] == "queued"
        assert minutely["outcome"]["url"] == reverse("admin:jobs_job_change", args=[fired.pk])
        assert nightly["status"].timezone == "Europe/Berlin" and nightly["outcome"] is None
        body = page.content.decode()
        for text in ("* * * * *", "0 3 * * *", "Europe/Berlin", "once", "never fired"):
            assert text in body
        assert f'<time datetime="{minute(now).isoformat()}"' in body  # to the second, zoned
        assert "Run now…" in body and "Pause…" in body

        recent = page.context["slots"]
        assert [(i["row"].schedule, i["row"].kind) for i in recent] == [("minutely", "on_time")]
        assert recent[0]["outcome"]["pk"] == fired.pk

    def test_the_last_slots_job_is_found_in_the_history_or_called_pruned(self, ops):
        now = database_now()
        (archived,) = finish(job(), state="failed")
        history.archive(now=now + timedelta(minutes=2))
        assert JobHistory.objects.filter(pk=archived).exists()
        older = minute(now) - timedelta(minutes=5)
        for offset, pk, job_id in ((0, archived, "cron:minutely:a"), (1, 999_999, "cron:b")):
            ScheduleSlot.objects.create(
                schedule="minutely",
                slot=older + timedelta(minutes=offset),
                kind=SlotKind.ON_TIME,
                job_pk=pk,
                job_id=job_id,
            )
        page = ops.get(PAGE)

        last = row_of(page, "minutely")["outcome"]
        assert (last["state"], last["job_id"]) == ("pruned", "cron:b")
        outcomes = [item["outcome"] for item in page.context["slots"]]
        assert outcomes[0]["state"] == "pruned"
        assert (outcomes[1]["state"], outcomes[1]["archived"], outcomes[1]["error"]) == (
            "failed",
            True,
            "handler_error",
        )
        assert outcomes[1]["url"] == reverse("admin:jobs_jobhistory_change", args=[archived])
        assert "pruned" in page.content.decode()

    def test_recent_slots_newest_first_and_for_one_schedule(self, ops):
        now = database_now()
        tick(now - timedelta(minutes=3))
        tick(now)  # misfire "all": the two missed minutes catch up
        page = ops.get(PAGE, {"schedule": "minutely"})

        kinds = [(i["row"].slot, i["row"].kind) for i in page.context["slots"]]
        assert kinds == [
            (minute(now), "on_time"),
            (minute(now) - timedelta(minutes=1), "catch_up"),
            (minute(now) - timedelta(minutes=2), "catch_up"),
            (minute(now) - timedelta(minutes=3), "on_time"),
        ]
        assert page.context["selected"] == "minutely"

    def test_a_fixed_number_of_queries_however_many_slots(self, ops, django_assert_max_num_queries):
        now = database_now()
        for minutes in (30, 20, 10, 0):
            tick(now - timedelta(minutes=minutes))
        ops.get(PAGE)  # the session and permissions are cached from here on
        # Session, user, permissions (2), clock, status, recent slots, jobs, history, pauses.
        with django_assert_max_num_queries(10):
            assert len(ops.get(PAGE).context["slots"]) > 10

    def test_viewing_needs_view_permission_on_slots_or_jobs(self):
        assert client_for(operator("nobody", "jobs.view_pause")).get(PAGE).status_code == 403
        tick(database_now())
        slots_only = client_for(operator("slots", "jobs.view_scheduleslot")).get(PAGE)
        assert slots_only.status_code == 200
        assert row_of(slots_only, "minutely")["outcome"]["url"] is None  # no jobs to link to
        body = slots_only.content.decode()
        assert 'class="button jobs-run"' not in body and 'class="button jobs-pause"' not in body

    @override_settings(JOBS={"SCHEDULES": {"x": {"cron": "* * *", "job": "jobapp.ping.v1"}}})
    def test_invalid_schedules_are_shown_not_a_crash(self, ops):
        page = ops.get(PAGE)
        assert page.status_code == 200 and "Invalid schedules" in page.context["problem"]

    @override_settings(JOBS={"SCHEDULES": {}})
    def test_no_schedule_says_how_to_add_one(self, ops, monkeypatch):
        monkeypatch.setattr(schedules_module, "_declared", [])  # the demo app declares one
        monkeypatch.setattr(schedules_module, "_loaded", None)
        assert b"No schedule is configured" in ops.get(PAGE).content


class TestRunNow:
    def test_get_asks_first_and_enqueues_nothing(self, ops):
        page = ops.get(RUN)

        assert page.status_code == 200
        assert page.templates[0].name == "admin/jobs/schedules/run_confirmation.html"
        assert "Yes, run minutely now" in page.content.decode()
        assert len(page.context["token"]) == 32
        assert not Job.objects.exists() and not LogEntry.objects.exists()

    def test_the_confirming_post_enqueues_one_job_no_slot_and_logs_it_once(self, ops):
        token = ops.get(RUN).context["token"]

        first = ops.post(RUN, {"post": "yes", "token": token}, follow=True)
        again = ops.post(RUN, {"post": "yes", "token": token}, follow=True)

        assert first.redirect_chain == [(PAGE, 302)]
        created = Job.objects.get()
        assert (created.name, created.payload, created.tenant) == (
            "jobapp.ping.v1",
            {"message": "tick"},
            "acme",
        )
        assert created.job_id == f"run:minutely:{token}"
        assert not created.job_id.startswith("cron:")  # a slot's never can be this
        assert not ScheduleSlot.objects.exists()
        entry = LogEntry.objects.get()
        assert (entry.user.username, entry.action_flag, entry.object_id) == (
            "ops",
            ADDITION,
            str(created.pk),
        )
        assert (
            entry.change_message
            == f"Ran schedule minutely now via the admin: job run:minutely:{token}"
        )
        assert messages_of(again) == [
            f"That run was enqueued already (job {created.pk}): nothing more was enqueued."
        ]
        # A fresh confirmation is a fresh run.
        ops.post(RUN, {"post": "yes", "token": ops.get(RUN).context["token"]})
        assert Job.objects.count() == 2 and LogEntry.objects.count() == 2

    def test_the_next_slot_fires_as_usual_after_a_run_now(self, ops):
        ops.post(RUN, {"post": "yes", "token": control.new_token()})
        counts = tick(database_now())
        assert counts.on_time == 1 and Job.objects.count() == 2
        assert len(slots()) == 1

    def test_refused_without_the_permission(self):
        client = client_for(operator("viewer", "jobs.view_job", "jobs.pause_work"))
        assert client.get(RUN).status_code == 403
        assert client.post(RUN, {"post": "yes", "token": control.new_token()}).status_code == 403
        assert not Job.objects.exists()
        assert b"jobs-run" not in client.get(PAGE).content

    def test_the_confirmation_shows_the_schedule_only_to_who_may_view_schedules(self):
        """Its payload, job type and tenant are the schedule's: viewing them needs the
        schedules' view permission, and running still needs jobs.run_schedule."""
        blind = client_for(operator("blind", "jobs.run_schedule"))

        page = blind.get(RUN)

        assert page.status_code == 403 and b"tick" not in page.content
        assert blind.post(RUN, {"post": "yes", "token": control.new_token()}).status_code == 403
        assert not Job.objects.exists() and not LogEntry.objects.exists()
        slots_viewer = client_for(operator("slots", "jobs.view_scheduleslot", "jobs.run_schedule"))
        assert b"tick" in slots_viewer.get(RUN).content

    def test_a_post_without_its_csrf_token_is_refused(self):
        client = csrf_client(operator("ops", *ALL))
        assert client.post(RUN, {"post": "yes", "token": control.new_token()}).status_code == 403
        assert not Job.objects.exists()

    def test_a_forged_token_or_an_unknown_schedule_enqueues_nothing(self, ops):
        bad = ops.post(RUN, {"post": "yes", "token": "../x"}, follow=True)
        assert messages_of(bad) == ["That confirmation is not valid: ask again."]
        unknown = reverse("admin:jobs_schedule_run", args=["nope"])
        assert ops.get(unknown).status_code == 404
        assert not Job.objects.exists() and not LogEntry.objects.exists()


class TestPauseAndResume:
    def test_pause_asks_first_then_stops_the_scheduler_firing(self, ops):
        now = database_now()
        page = ops.get(PAUSE)
        assert page.templates[0].name == "admin/jobs/schedules/pause_confirmation.html"
        assert not Pause.objects.exists()

        done = ops.post(PAUSE, {"post": "yes", "reason": "INC-9"}, follow=True)

        assert done.redirect_chain == [(PAGE, 302)]
        pause = Pause.objects.get()
        assert (pause.kind, pause.value, pause.paused_by, pause.reason) == (
            "schedule",
            "minutely",
            "ops",
            "INC-9",
        )
        assert LogEntry.objects.get().change_message == "Paused via the admin: INC-9"
        counts = tick(now + timedelta(minutes=1))
        assert (counts.on_time, counts.paused) == (0, 1)
        assert slots() == [] and not Job.objects.filter(job_id__contains="minutely").exists()
        listed = row_of(ops.get(PAGE), "minutely")
        assert listed["pause"].reason == "INC-9" and not listed["status"].overdue
        assert b"jobs-resume" in ops.get(PAGE).content

    def test_resume_records_the_slots_let_pass_as_skipped_and_the_next_fires_on_time(self, ops):
        now = database_now()
        tick(now - timedelta(minutes=10))  # fired ten minutes ago, then paused
        ops.post(PAUSE, {"post": "yes"})
        assert tick(now - timedelta(minutes=5)).paused == 1

        page = ops.get(RESUME)
        assert page.templates[0].name == "admin/jobs/schedules/resume_confirmation.html"
        assert Pause.objects.exists()
        done = ops.post(RESUME, {"post": "yes"}, follow=True)

        assert not Pause.objects.exists()
        first = minute(now) - timedelta(minutes=10)
        [fired, skipped] = slots()
        assert fired == (first, "on_time", None)
        assert skipped[1:] == ("skipped", first + timedelta(minutes=1))
        assert minute(now) <= skipped[0] <= minute(database_now())
        assert "recorded as skipped" in messages_of(done)[0]
        entry = LogEntry.objects.get(action_flag=DELETION)
        assert "recorded as skipped" in entry.change_message
        recorded = ScheduleSlot.objects.get(kind="skipped")
        assert recorded.recorded_by == "resumed by ops"

        # misfire "all" would fire ten catch-ups for the stretch; the next slot fires alone.
        counts = tick(skipped[0] + timedelta(minutes=1, seconds=1))
        assert (counts.on_time, counts.catch_up, counts.skipped) == (1, 0, 0)

    def test_resume_from_the_pauses_page_records_the_skipped_slots_too(self, ops):
        tick(database_now() - timedelta(minutes=3))
        queue.pause("schedule", "minutely", by="someone")
        pause = Pause.objects.get()
        ops.post(reverse("admin:jobs_pause_resume", args=[pause.pk]), {"post": "yes"})
        assert [kind for _, kind, _ in slots()] == ["on_time", "skipped"]

    def test_the_pauses_page_pauses_a_schedule_too_and_says_what_that_does(self, ops):
        add = reverse("admin:jobs_pause_add")
        page = ops.get(add, {"kind": "schedule", "value": "minutely"})
        assert page.status_code == 200 and "fires no slot" in page.context["effect"]
        ops.post(add, {"kind": "schedule", "value": "minutely", "post": "yes"})
        assert tick(database_now() + timedelta(minutes=1)).paused == 1

    def test_pausing_or_resuming_twice_acts_once(self, ops):
        ops.post(PAUSE, {"post": "yes"}, follow=True)
        second = ops.post(PAUSE, {"post": "yes"}, follow=True)
        assert messages_of(second) == ["Schedule minutely was paused already: nothing changed."]
        ops.post(RESUME, {"post": "yes"}, follow=True)
        again = ops.post(RESUME, {"post": "yes"}, follow=True)
        assert messages_of(again) == ["Schedule minutely was not paused: nothing changed."]
        assert LogEntry.objects.count() == 2

    def test_refused_without_pause_work_and_without_csrf(self):
        runner = client_for(operator("runner", "jobs.view_job", "jobs.run_schedule"))
        for url in (PAUSE, RESUME):
            assert runner.get(url).status_code == 403
            assert runner.post(url, {"post": "yes"}).status_code == 403
        assert csrf_client(operator("ops", *ALL)).post(PAUSE, {"post": "yes"}).status_code == 403
        assert not Pause.objects.exists() and not LogEntry.objects.exists()

    def test_the_confirmations_show_the_schedule_only_to_who_may_view_schedules(self):
        blind = client_for(operator("blind", "jobs.pause_work"))
        for url in (PAUSE, RESUME):
            page = blind.get(url)
            assert page.status_code == 403 and b"jobapp.ping.v1" not in page.content
            assert blind.post(url, {"post": "yes"}).status_code == 403
        assert not Pause.objects.exists() and not LogEntry.objects.exists()


class TestPausedStretch:
    """The rule at pinned times: :func:`jobs.catalogue.timing.skipped_while_paused`."""

    T = datetime(2030, 5, 1, 10, tzinfo=UTC)
    UTC_ZONE = ZoneInfo("UTC")

    def test_one_row_from_the_slot_after_the_last_to_the_latest_due(self):
        decision = timing.skipped_while_paused(
            "0 * * * *", self.UTC_ZONE, last=self.T, since=self.T, now=self.T + timedelta(hours=3.5)
        )
        assert decision == timing.Decision(
            self.T + timedelta(hours=3), SlotKind.SKIPPED, self.T + timedelta(hours=1)
        )

    def test_nothing_when_no_slot_came_due(self):
        assert (
            timing.skipped_while_paused(
                "0 * * * *",
                self.UTC_ZONE,
                last=self.T,
                since=self.T,
                now=self.T + timedelta(minutes=59),
            )
            is None
        )

    def test_a_schedule_that_never_fired_counts_from_the_pause(self):
        decision = timing.skipped_while_paused(
            "0 * * * *",
            self.UTC_ZONE,
            last=None,
            since=self.T + timedelta(minutes=30),
            now=self.T + timedelta(hours=2, minutes=5),
        )
        assert decision is not None
        assert (decision.missed_from, decision.slot) == (
            self.T + timedelta(hours=1),
            self.T + timedelta(hours=2),
        )

    def test_status_of_a_paused_schedule_is_never_overdue(self):
        (before,) = [s for s in status(now=self.T) if s.name == "minutely"]
        queue.pause("schedule", "minutely", by="test")
        late = self.T + timedelta(hours=5)
        (paused,) = [s for s in status(now=late) if s.name == "minutely"]
        assert (paused.paused, paused.overdue, paused.next_due) == (
            True,
            False,
            late + timedelta(minutes=1),
        )
        assert not before.paused

    def test_resume_with_a_pinned_now(self):
        tick(self.T)
        queue.pause("schedule", "minutely", by="test")
        done = pausing.resume("minutely", by="test", now=self.T + timedelta(minutes=3, seconds=5))
        assert done and done.skipped is not None
        assert slots() == [
            (self.T, "on_time", None),
            (self.T + timedelta(minutes=3), "skipped", self.T + timedelta(minutes=1)),
        ]
        assert not pausing.resume("minutely", by="test")  # not paused now


class TestCommand:
    def run(self, *args: str) -> str:
        out = StringIO()
        call_command("jobs", *args, stdout=out)
        return out.getvalue()

    def test_run_now_pause_and_resume_a_schedule_as_a_named_user(self):
        operator("alice", "jobs.run_schedule", "jobs.pause_work")
        said = self.run("run-now", "minutely", "--user", "alice")
        created = Job.objects.get()
        assert said == f"Enqueued job {created.pk} ({created.job_id}) of schedule minutely.\n"
        assert created.job_id.startswith("run:minutely:") and not ScheduleSlot.objects.exists()
        assert self.run("pause", "schedule", "minutely", "--user", "alice") == (
            "Paused schedule minutely.\n"
        )
        assert tick(database_now() + timedelta(minutes=1)).paused == 1
        assert self.run("resume", "schedule", "minutely", "--user", "alice") == (
            "Resumed schedule minutely.\n"
        )
        assert LogEntry.objects.filter(user__username="alice").count() == 3

    def test_refused_without_the_permission_or_for_an_unknown_schedule(self):
        operator("bob", "jobs.pause_work")
        with pytest.raises(CommandError, match=r"jobs\.run_schedule"):
            self.run("run-now", "minutely", "--user", "bob")
        operator("carol", "jobs.run_schedule")
        with pytest.raises(CommandError, match="No schedule named nope is configured"):
            self.run("run-now", "nope", "--user", "carol")
        assert not Job.objects.exists()
