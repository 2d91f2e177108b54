"""``manage.py jobs pause|resume|paused|cancel`` and the control functions under them."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.core.exceptions import PermissionDenied
from django.core.management import CommandError, call_command

from jobs import queue
from jobs.control import cancels, pauses
from jobs.models import Job, Pause
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
)
from tests.support.admin import operator
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command("jobs", *args, stdout=out)
    return out.getvalue()


def running_job(name: str = "test.running.v1") -> int:
    queue.enqueue(NewJob(name))
    [job] = queue.claim([ClaimRequest(name, 1)], scope=AllTenants(), worker="w")
    return job.id


class TestPauseCommand:
    def test_pause_and_resume_are_made_and_logged_under_the_user(self):
        alice = operator("alice", "jobs.pause_work")

        out = run("pause", "queue", "emails", "--user", "alice", "--reason", "smtp down")

        assert out.strip() == "Paused queue emails."
        row = Pause.objects.get()
        assert (row.kind, row.value, row.paused_by, row.reason) == (
            "queue",
            "emails",
            "alice",
            "smtp down",
        )
        [entry] = LogEntry.objects.filter(user=alice)
        assert entry.action_flag == ADDITION
        assert entry.change_message == "Paused via manage.py jobs: smtp down"
        assert "emails" in run("paused")

        assert (
            run("resume", "queue", "emails", "--user", "alice").strip() == "Resumed queue emails."
        )
        assert not Pause.objects.exists()
        assert LogEntry.objects.filter(user=alice, action_flag=DELETION).count() == 1
        assert run("paused").strip() == "Nothing is paused."

    def test_a_repeated_pause_or_resume_changes_and_logs_nothing(self):
        operator("alice", "jobs.pause_work")
        run("pause", "tenant", "acme", "--user", "alice")
        assert "paused already" in run("pause", "tenant", "acme", "--user", "alice")
        run("resume", "tenant", "acme", "--user", "alice")
        assert "was not paused" in run("resume", "tenant", "acme", "--user", "alice")
        assert LogEntry.objects.count() == 2

    def test_a_user_without_the_permission_is_refused_and_nothing_changes(self):
        operator("bob", "jobs.change_job")
        with pytest.raises(CommandError, match=r"user 'bob'.*jobs\.pause_work"):
            run("pause", "job_type", "mail.send.v1", "--user", "bob")
        assert not Pause.objects.exists() and not LogEntry.objects.exists()

    @pytest.mark.parametrize(
        "user,message",
        [("nobody", "no user 'nobody'"), ("carol", "not staff")],
    )
    def test_unknown_and_non_staff_users_are_refused(self, user, message):
        operator("carol", "jobs.pause_work", staff=False)
        with pytest.raises(CommandError, match=message):
            run("pause", "queue", "q", "--user", user)

    def test_a_bad_name_is_a_clear_error(self):
        operator("alice", "jobs.pause_work")
        with pytest.raises(CommandError, match="1-64 characters"):
            run("pause", "queue", "q" * 65, "--user", "alice")

    def test_the_control_function_refuses_without_the_permission(self):
        with pytest.raises(PermissionDenied):
            pauses.pause(operator("dave"), "queue", "q", via="test")


class TestCancelCommand:
    def test_queued_jobs_end_and_running_ones_are_asked_each_logged(self):
        alice = operator("alice", "jobs.cancel_job")
        queued = JobFactory()
        running = running_job()
        done = JobFactory(succeeded=True)

        out = run("cancel", str(queued.pk), str(running), str(done.pk), "--user", "alice")

        assert "Cancelled 1 queued job." in out
        assert "Asked 1 running job to stop" in out
        assert "1 job was left alone" in out
        assert Job.objects.get(pk=queued.pk).state == "cancelled"
        asked = Job.objects.get(pk=running)
        assert (asked.state, asked.cancel_requested_by) == ("running", "alice")
        messages = sorted(
            LogEntry.objects.filter(user=alice, action_flag=CHANGE).values_list(
                "object_id", "change_message"
            )
        )
        assert messages == sorted(
            [
                (str(queued.pk), "Cancelled via manage.py jobs"),
                (str(running), "Asked to stop (running) via manage.py jobs"),
            ]
        )

    def test_cancel_all_takes_the_matching_active_jobs_within_the_limit(self):
        operator("alice", "jobs.cancel_job")
        mine = [JobFactory(name="a.v1", tenant="acme").pk for _ in range(3)]
        other = JobFactory(name="a.v1", tenant="other")
        JobFactory(name="b.v1", tenant="acme")

        dry = run(
            "cancel",
            "--all",
            "--job-type",
            "a.v1",
            "--tenant",
            "acme",
            "--dry-run",
            "--user",
            "alice",
        )
        assert "3 active jobs match; taking 3." in dry
        assert Job.objects.filter(state="cancelled").count() == 0

        out = run(
            "cancel",
            "--all",
            "--job-type",
            "a.v1",
            "--tenant",
            "acme",
            "--limit",
            "2",
            "--user",
            "alice",
        )

        assert "taking 2" in out and "Cancelled 2 queued jobs." in out
        cancelled = set(Job.objects.filter(state="cancelled").values_list("pk", flat=True))
        assert cancelled == set(sorted(mine)[-2:])  # the newest first
        assert Job.objects.get(pk=other.pk).state == "queued"

    def test_ids_and_all_together_are_refused(self):
        operator("alice", "jobs.cancel_job")
        with pytest.raises(CommandError, match="either job ids or --all"):
            run("cancel", "1", "--all", "--user", "alice")
        with pytest.raises(CommandError, match="either job ids or --all"):
            run("cancel", "--user", "alice")

    def test_a_user_without_the_permission_is_refused(self):
        operator("bob", "jobs.change_job")
        queued = JobFactory()
        with pytest.raises(CommandError, match=r"jobs\.cancel_job"):
            run("cancel", str(queued.pk), "--user", "bob")
        assert Job.objects.get(pk=queued.pk).state == "queued"

    def test_two_cancels_of_one_running_job_ask_and_log_once(self):
        alice = operator("alice", "jobs.cancel_job")
        running = running_job()
        first = cancels.cancel(alice, [running], via="test")
        second = cancels.cancel(alice, [running], via="test")
        assert (first.stopping, second.stopping, second.untouched) == ((running,), (), (running,))
        assert LogEntry.objects.filter(user=alice).count() == 1


NOOP = "test.noop.v1"


@pytest.mark.django_db
def test_cancel_all_with_a_limit_of_zero_is_refused_and_cancels_nothing():
    operator("alice", "jobs.cancel_job")
    queue.enqueue(NewJob(NOOP))
    queue.enqueue(NewJob(NOOP))

    with pytest.raises(CommandError):
        call_command(
            "jobs", "cancel", "--all", "--limit", "0", "--user", "alice", stdout=StringIO()
        )

    assert Job.objects.filter(state="queued").count() == 2


@pytest.mark.django_db
def test_the_command_refuses_non_staff_and_users_without_the_permission():
    operator("nostaff", "jobs.cancel_job", "jobs.pause_work", staff=False)
    operator("noperm")
    queue.enqueue(NewJob(NOOP))
    for user in ("nostaff", "noperm", "nobody"):
        with pytest.raises(CommandError):
            call_command("jobs", "cancel", "--all", "--user", user, stdout=StringIO())
        with pytest.raises(CommandError):
            call_command("jobs", "pause", "queue", "q", "--user", user, stdout=StringIO())
    assert Job.objects.get().state == "queued" and not Pause.objects.exists()
