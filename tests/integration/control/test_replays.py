"""Replay: a failed job queued again under its id, from the jobs table or the history.

Through the queue (fresh attempts, keys taken back only from expired holders, one replay of
rows sharing a key), across the history boundary (a row the archive moved, or moves while the
replay runs), and from the admin and the command: confirmation, permissions, CSRF, records,
idempotency.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from jobs import queue
from jobs.admin import modeladmin, views
from jobs.control.failures import fetch_page
from jobs.control.replays import replay as monitor_replay
from jobs.control.tables import Filters, RunTable, run_tables
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory
from jobs.queue import NewJob, history
from jobs.runs import RunState
from project.curation.models import CurationRun
from project.harvester.models import DeadLetter
from project.mail.models import Delivery
from tests.support.admin import REPLAY_ALL, VIEW_ALL, client_for, operator
from tests.support.concurrency import Background
from tests.support.factories import (
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    JobFactory,
    ago,
)
from tests.support.history import MINUTE, finish, job, where
from tests.support.polling import wait_for

pytestmark = pytest.mark.django_db

REPLAY = "admin:jobs_monitor_replay"


def confirm(client: Client, *tokens: str, next_url: str = "/admin/jobs/job/monitor/"):
    return client.post(
        reverse(REPLAY), {"rows": " ".join(tokens), "confirm": "yes", "next": next_url}
    )


def log_for(obj) -> list[LogEntry]:
    return list(
        LogEntry.objects.filter(object_id=str(obj.pk), content_type__model=obj._meta.model_name)
    )


def test_the_per_row_button_asks_first_and_replays_only_on_the_confirming_post():
    job = JobFactory(failed=True, job_id="invoice-42")
    ops = operator("alice", *VIEW_ALL, *REPLAY_ALL)
    client = client_for(ops)

    page = client.get(reverse(REPLAY), {"rows": f"jobs.job:{job.pk}", "confirm": "yes"})

    assert page.status_code == 200 and b"invoice-42" in page.content
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED  # a GET changes nothing

    response = confirm(client, f"jobs.job:{job.pk}", next_url="/admin/jobs/job/monitor/?q=x")

    assert response.status_code == 302 and response["Location"] == "/admin/jobs/job/monitor/?q=x"
    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.replayed_by) == (RunState.QUEUED, "alice")
    [entry] = log_for(job)
    assert (entry.user_id, entry.action_flag) == (ops.pk, CHANGE)
    assert entry.change_message.startswith("Replayed via the admin failure monitor")
    messages = [str(m) for m in response.wsgi_request._messages]
    assert messages == ["Replayed 1 row (1 jobs.job)."]


def test_bulk_replay_dispatches_each_row_to_its_own_domain():
    job = JobFactory(failed=True)
    delivery = DeliveryFactory()
    dead = DeadLetterFactory()
    run = CurationRunFactory()
    done = DeliveryFactory(state=RunState.SUCCEEDED)
    tokens = [
        f"jobs.job:{job.pk}",
        f"mail.delivery:{delivery.pk}",
        f"harvester.deadletter:{dead.pk}",
        f"curation.curationrun:{run.pk}",
        f"mail.delivery:{done.pk}",
    ]
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    page = client.post(reverse(REPLAY), {"rows": tokens, "next": "/admin/"})

    assert page.status_code == 200
    assert page.context["eligible"] == 4 and page.context["skipped"] == 1
    assert b"resend the message" in page.content and b"not a retry" in page.content

    confirm(client, page.context["tokens"])

    assert Job.objects.get(pk=job.pk).state == RunState.QUEUED
    assert Delivery.objects.get(pk=delivery.pk).resends == 1
    assert DeadLetter.objects.get(pk=dead.pk).state == RunState.QUEUED
    assert CurationRun.objects.get(replay_of=run).state == RunState.QUEUED
    assert CurationRun.objects.get(pk=run.pk).state == RunState.FAILED  # kept as history
    assert LogEntry.objects.count() == 4
    queued = set(Job.objects.filter(state=RunState.QUEUED).values_list("name", flat=True))
    assert queued == {"test.noop.v1", "mail.deliver.v1", "harvester.harvest.v1", "curation.pass.v1"}


def test_replay_all_matching_is_bounded_and_shows_the_count(monkeypatch):
    monkeypatch.setattr(views, "REPLAY_ALL_LIMIT", 3)
    rows = [DeliveryFactory(finished_at=ago(minutes=m)) for m in range(1, 6)]
    JobFactory(failed=True)  # another module: not matched
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    page = client.get(reverse(REPLAY), {"all": "1", "module": "mail.delivery"})

    assert page.context["matching"] == 5 and page.context["eligible"] == 3
    assert b"Only the newest 3" in page.content
    confirm(client, page.context["tokens"])
    resent = set(Delivery.objects.filter(resends=1).values_list("pk", flat=True))
    assert resent == {row.pk for row in rows[:3]}
    assert Job.objects.get(name="test.noop.v1").state == RunState.FAILED


def test_replay_all_never_widens_a_filter_it_cannot_apply():
    """A module the user may not replay, or a bad value, is refused: never "all the rest"."""
    JobFactory(failed=True, job_id="unrelated-job")
    DeliveryFactory()
    jobs_only = client_for(operator("ops", *VIEW_ALL, "jobs.replay_job"))

    other_module = jobs_only.get(reverse(REPLAY), {"all": "1", "module": "mail.delivery"})
    bad_value = jobs_only.get(reverse(REPLAY), {"all": "1", "error": "no-such-code"})

    assert other_module.status_code == 403 and b"unrelated-job" not in other_module.content
    assert bad_value.status_code == 302 and b"unrelated-job" not in bad_value.content
    [message] = [str(m) for m in bad_value.wsgi_request._messages]
    assert message.startswith("Nothing to replay: the filter is not valid (error:")


def test_a_request_naming_more_rows_than_the_bound_is_refused(monkeypatch):
    """The pages never send more than the bound; a crafted request cannot either."""
    monkeypatch.setattr(views, "REPLAY_ALL_LIMIT", 2)
    tokens = [f"mail.delivery:{DeliveryFactory().pk}" for _ in range(3)]
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    asked = client.post(reverse(REPLAY), {"rows": tokens, "next": "/admin/"})
    confirmed = confirm(client, *tokens)

    assert (asked.status_code, confirmed.status_code) == (302, 302)
    assert not Delivery.objects.filter(resends__gt=0).exists() and not LogEntry.objects.exists()
    message = [str(m) for m in confirmed.wsgi_request._messages][-1]
    assert message == "Replay at most 2 rows at once; 3 were named."


def test_anonymous_users_cannot_replay():
    job = JobFactory(failed=True)
    response = confirm(Client(), f"jobs.job:{job.pk}")
    assert response.status_code == 302 and "/login/" in response["Location"]
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED


def test_staff_without_the_replay_permission_are_refused():
    job = JobFactory(failed=True)
    viewer = client_for(operator("viewer", *VIEW_ALL))

    assert viewer.get(reverse(REPLAY), {"rows": f"jobs.job:{job.pk}"}).status_code == 403
    assert confirm(viewer, f"jobs.job:{job.pk}").status_code == 403
    assert viewer.get(reverse(REPLAY), {"all": "1"}).status_code == 403
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED and not LogEntry.objects.exists()


def test_the_permission_is_per_table():
    delivery = DeliveryFactory()
    jobs_only = client_for(operator("ops", *VIEW_ALL, "jobs.replay_job"))

    assert confirm(jobs_only, f"mail.delivery:{delivery.pk}").status_code == 403
    assert Delivery.objects.get(pk=delivery.pk).state == RunState.FAILED


def test_the_confirming_post_needs_a_csrf_token():
    job = JobFactory(failed=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    assert confirm(client, f"jobs.job:{job.pk}").status_code == 403
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED


def test_a_double_click_replays_once_and_records_once():
    delivery = DeliveryFactory()
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    confirm(client, f"mail.delivery:{delivery.pk}")
    second = confirm(client, f"mail.delivery:{delivery.pk}")

    assert Delivery.objects.get(pk=delivery.pk).resends == 1
    assert len(log_for(delivery)) == 1
    message = [str(m) for m in second.wsgi_request._messages][-1]
    assert message.startswith("Replayed 0 rows. 1 row was not replayed")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "make", [JobFactory, DeliveryFactory, DeadLetterFactory, CurationRunFactory]
)
def test_two_operators_at_once_replay_a_row_once(threads, make):
    row = make(failed=True) if make is JobFactory else make()
    label = row._meta.label_lower
    clients = [client_for(operator(name, *VIEW_ALL, *REPLAY_ALL)) for name in ("alice", "bob")]

    threads(2, lambda i: confirm(clients[i], f"{label}:{row.pk}"))

    [entry] = log_for(row)  # exactly one operator replayed it, and only that one recorded it
    assert entry.user.username in {"alice", "bob"}
    new_jobs = Job.objects.filter(state=RunState.QUEUED).count()
    assert new_jobs == 1  # one job re-queued or enqueued, whichever the domain does
    if make is CurationRunFactory:
        assert CurationRun.objects.filter(replay_of=row).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_requests_that_truly_overlap_resend_once():
    """Both requests are held on the row's lock until both wait, then let go together."""
    delivery = DeliveryFactory()
    clients = [client_for(operator(name, *VIEW_ALL, *REPLAY_ALL)) for name in ("al", "bo")]
    responses: list = []

    def post(client: Client) -> None:
        try:
            responses.append(confirm(client, f"mail.delivery:{delivery.pk}").status_code)
        finally:
            connection.close()

    probe = _probe_connection()
    try:
        with transaction.atomic():
            Delivery.objects.select_for_update().get(pk=delivery.pk)
            started = [threading.Thread(target=post, args=(c,)) for c in clients]
            for thread in started:
                thread.start()
            wait_for(lambda: _waiting_on_locks(probe) == 2)
    finally:
        probe.close()
    for thread in started:
        thread.join(30)

    assert responses == [302, 302]
    assert Delivery.objects.get(pk=delivery.pk).resends == 1
    assert Job.objects.filter(name="mail.deliver.v1").count() == 1
    assert len(log_for(delivery)) == 1


def _probe_connection():
    """A second connection of this thread, outside the test's open transaction."""
    default = connections["default"]
    return default.__class__(default.settings_dict, "probe")


def _waiting_on_locks(probe) -> int:
    with probe.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return cur.fetchone()[0]


def test_next_must_point_back_into_this_site():
    job = JobFactory(failed=True)
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))
    response = confirm(client, f"jobs.job:{job.pk}", next_url="https://evil.example/")
    assert response["Location"] == reverse("admin:jobs_monitor")


def test_the_admin_action_shows_the_same_confirmation():
    delivery = DeliveryFactory(job_id="welcome-3")
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    page = client.post(
        reverse("admin:mail_delivery_changelist"),
        {"action": "replay_selected", "_selected_action": [delivery.pk]},
    )

    assert page.status_code == 200 and b"resend the message" in page.content
    assert page.context["tokens"] == f"mail.delivery:{delivery.pk}"
    assert Delivery.objects.get(pk=delivery.pk).resends == 0


def test_the_admin_action_over_select_all_takes_the_newest_eligible_rows_and_says_so(
    monkeypatch,
):
    monkeypatch.setattr(modeladmin, "REPLAY_ALL_LIMIT", 3)
    for _ in range(3):
        DeliveryFactory(state=RunState.SUCCEEDED)  # the oldest rows: nothing to replay there
    failed = [DeliveryFactory() for _ in range(4)]
    client = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))

    page = client.post(
        reverse("admin:mail_delivery_changelist"),
        {"action": "replay_selected", "select_across": "1", "_selected_action": [failed[0].pk]},
    )

    assert (page.context["matching"], page.context["eligible"]) == (4, 3)
    assert page.context["tokens"].split() == [f"mail.delivery:{d.pk}" for d in failed[:0:-1]]
    assert b"Only the newest 3" in page.content


def test_the_detail_page_offers_replay_only_when_it_applies():
    failed, done = DeliveryFactory(), DeliveryFactory(state=RunState.SUCCEEDED)
    replayer = client_for(operator("alice", *VIEW_ALL, *REPLAY_ALL))
    viewer = client_for(operator("viewer", *VIEW_ALL))

    def has_button(client, obj) -> bool:
        url = reverse("admin:mail_delivery_change", args=[obj.pk])
        return b'id="replay-row"' in client.get(url).content

    assert has_button(replayer, failed)
    assert not has_button(replayer, done)
    assert not has_button(viewer, failed)


class TestReplayCommand:
    def test_replays_ids_as_the_named_user_and_records_it(self):
        operator("alice", "mail.view_delivery", "mail.replay_delivery")
        delivery = DeliveryFactory()

        call_command("replay", str(delivery.pk), user="alice", model="mail.delivery")

        assert Delivery.objects.get(pk=delivery.pk).resends == 1
        [entry] = log_for(delivery)
        assert entry.change_message.startswith("Replayed via manage.py replay")

    def test_refuses_a_user_without_the_permission(self):
        operator("bob", "mail.view_delivery")
        delivery = DeliveryFactory()
        with pytest.raises(CommandError, match=r"needs the mail\.replay_delivery permission"):
            call_command("replay", str(delivery.pk), user="bob", model="mail.delivery")
        assert Delivery.objects.get(pk=delivery.pk).resends == 0

    def test_refuses_a_user_who_may_replay_but_not_view_the_table(self):
        operator("carol", "mail.replay_delivery")
        delivery = DeliveryFactory()
        with pytest.raises(CommandError, match=r"needs the mail\.view_delivery permission"):
            call_command("replay", str(delivery.pk), user="carol", model="mail.delivery")
        with pytest.raises(CommandError, match=r"needs the mail\.view_delivery permission"):
            call_command("replay", "--all", "--dry-run", user="carol", model="mail.delivery")
        assert Delivery.objects.get(pk=delivery.pk).resends == 0

    def test_refuses_a_user_who_is_not_staff(self):
        """The admin admits staff only; the command applies the same rule."""
        user = operator("dave", "mail.view_delivery", "mail.replay_delivery", staff=False)
        delivery = DeliveryFactory()
        with pytest.raises(CommandError, match=f"user {user.username!r} is not staff"):
            call_command("replay", str(delivery.pk), user="dave", model="mail.delivery")
        assert Delivery.objects.get(pk=delivery.pk).resends == 0

    def test_refuses_unknown_users_and_tables_and_ambiguous_selections(self):
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        with pytest.raises(CommandError, match="no user"):
            call_command("replay", "1", user="nobody")
        with pytest.raises(CommandError, match="no run table"):
            call_command("replay", "1", user="alice", model="mail.nothing")
        with pytest.raises(CommandError, match="either row ids or --all"):
            call_command("replay", "1", "--all", user="alice")

    def test_dry_run_changes_nothing(self, capsys):
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        job = JobFactory(failed=True)
        call_command("replay", str(job.pk), "--dry-run", user="alice")
        assert "Would replay 1 jobs.job rows" in capsys.readouterr().out
        assert Job.objects.get(pk=job.pk).state == RunState.FAILED

    def test_all_with_filters_is_bounded(self):
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        rows = [DeliveryFactory(finished_at=ago(minutes=m)) for m in range(1, 4)]
        DeliveryFactory(last_error="handler_error")

        call_command(
            "replay",
            "--all",
            "--error",
            "rejected",
            "--limit",
            "2",
            user="alice",
            model="mail.delivery",
        )

        resent = set(Delivery.objects.filter(resends=1).values_list("pk", flat=True))
        assert resent == {rows[0].pk, rows[1].pk}

    @pytest.mark.parametrize("limit", ["0", "-1"])
    def test_a_limit_below_one_is_refused_and_nothing_is_replayed(self, limit):
        """As ``manage.py jobs cancel`` refuses it: "at most 0 rows" never means one."""
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        job = JobFactory(failed=True)

        with pytest.raises(CommandError, match=f"--limit must be at least 1, got {limit}"):
            call_command("replay", "--all", "--limit", limit, user="alice")

        assert Job.objects.get(pk=job.pk).state == RunState.FAILED
        assert not LogEntry.objects.exists()

    @pytest.mark.parametrize("raw", ["abc", "", "1.5", "12x"])
    def test_a_malformed_id_is_an_error_naming_it(self, raw):
        """Not "Replayed 0 rows." and success: the id was never a row's."""
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        job = JobFactory(failed=True)

        with pytest.raises(CommandError, match=re.escape(f"{raw!r} is not an id of jobs.job")):
            call_command("replay", str(job.pk), raw, user="alice")

        assert Job.objects.get(pk=job.pk).state == RunState.FAILED
        assert not LogEntry.objects.exists()

    def test_a_malformed_id_is_an_error_in_a_dry_run_too(self):
        operator("alice", *VIEW_ALL, *REPLAY_ALL)
        with pytest.raises(CommandError, match=r"'abc' is not an id of mail\.delivery"):
            call_command("replay", "abc", "--dry-run", user="alice", model="mail.delivery")


def test_replay_needs_view_permission_on_every_table_it_names():
    """Holding only ``replay_job`` shows no job's job_id or error, and replays nothing."""
    job = JobFactory(failed=True, job_id="secret-invoice", error_detail="card 4242 declined")
    replay_only = client_for(operator("blind", "jobs.replay_job", "mail.view_delivery"))

    page = replay_only.get(reverse(REPLAY), {"rows": f"jobs.job:{job.pk}"})

    assert page.status_code == 403
    assert b"secret-invoice" not in page.content and b"4242" not in page.content
    assert confirm(replay_only, f"jobs.job:{job.pk}").status_code == 403
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED and not LogEntry.objects.exists()


def test_replay_by_crafted_post_names_a_table_the_user_may_not_view():
    """Rows of a table the user may replay but not view are refused with the rest of the post."""
    job, delivery = JobFactory(failed=True), DeliveryFactory()
    ops = client_for(operator("ops", "jobs.view_job", "jobs.replay_job", "mail.replay_delivery"))

    response = confirm(ops, f"jobs.job:{job.pk}", f"mail.delivery:{delivery.pk}")

    assert response.status_code == 403
    assert Delivery.objects.get(pk=delivery.pk).resends == 0
    assert Job.objects.get(pk=job.pk).state == RunState.FAILED


def lock_waiters(like: str = "%") -> int:
    """Sessions of this database waiting on a heavyweight lock, running a query like ``like``."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query LIKE %s",
            [like],
        )
        return cur.fetchone()[0]


@pytest.mark.django_db
def test_replaying_a_jobs_row_the_archive_moved_meanwhile_still_replays_it():
    """The monitor/admin/CLI replay of ``jobs.job:<id>`` finds a row the archive moved.

    The failure monitor lists a failed keyless job as ``jobs.job:<id>``; ten seconds after it
    failed (ARCHIVE_AFTER) the archive moves it. The operator's confirmation then goes to
    ``_replay_table`` for the jobs table, whose eligible rows include those the archive moved,
    so the row is replayed as ``queue.replay`` restores it, not reported "no longer eligible".
    The same holds for the Job admin's replay action and button on a stale page.
    """
    (pk,) = finish(job(), state="failed")
    table = RunTable(Job)
    assert table.eligible_pks([pk]) == [pk]  # what the operator's page offered
    history.archive(now=database_now() + MINUTE)
    assert where(pk) == "history"
    alice = operator("alice", "jobs.view_job", "jobs.replay_job")

    (result,) = monitor_replay(alice, {table: [pk]}, via="test")

    assert result.replayed == (pk,), "the archived failed job was not replayed"
    assert Job.objects.get(pk=pk).state == "queued"


@pytest.mark.django_db
def test_manage_py_replay_by_id_replays_a_job_that_was_archived():
    """``manage.py replay <id>`` (default ``--model jobs.job``) replays a job the archive moved.

    Every failed keyless job is archived 10 s after it fails, so a script that replays the ids
    it was alerted about must replay them from the history, not say "1 row was not replayed: it
    is no longer eligible (not failed, or already replayed)".
    """
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + MINUTE)
    operator("ops", "jobs.view_job", "jobs.replay_job")
    out = StringIO()

    call_command("replay", str(pk), "--user", "ops", stdout=out)

    assert where(pk) == "jobs" and Job.objects.get(pk=pk).state == "queued", out.getvalue()


@pytest.mark.django_db
def test_a_history_replay_records_only_the_rows_it_replayed():
    """A key-taken history row is neither reported nor logged as replayed.

    The history's replay returns a count; with a partial count ``_which`` asks which rows are
    "no longer eligible". A row whose key a newer job holds stays failed in the history, so it
    is not counted as replayed: the operator does not read "Replayed 2 rows", nor does a
    LogEntry say so, for a job that never runs.
    """
    (taken,) = finish(job("import-13"), state="failed")
    (free,) = finish(job(), state="failed")
    history.archive(now=database_now() + 2 * MINUTE)
    assert where(taken) == where(free) == "history"
    newer = queue.enqueue(job("import-13"))
    assert newer.created
    alice = operator("alice", "jobs.view_job", "jobs.replay_job")

    (result,) = monitor_replay(alice, {RunTable(JobHistory): [taken, free]}, via="test")

    # Key taken: it did not replay, and stays failed where it was (in the history).
    assert JobHistory.objects.get(pk=taken).state == "failed"
    assert Job.objects.get(pk=free).state == "queued"
    assert result.replayed == (free,)
    assert not LogEntry.objects.filter(object_id=str(taken)).exists()


@pytest.mark.django_db(transaction=True)
def test_a_replay_racing_an_archive_of_the_same_row_replays_it():
    """A replay that meets the archive mid-move still replays the row and reports it.

    replay() runs RESTORE (history -> jobs) while the archive's DELETE ... INSERT is not
    committed yet, so RESTORE sees no history row. The replay locks the ids' jobs rows first
    (FOR UPDATE waits for the move in flight), so once the archive commits it restores and
    replays the row: the id is in the report, and the failed job is not left in the history.
    """
    (pk,) = finish(job(), state="failed")
    later = database_now() + MINUTE
    with connection.cursor() as cur:  # no DDL inside the racing transaction
        history.ensure(cur, "failed", later - timedelta(days=1), later + timedelta(days=1))
    moved, release = threading.Event(), threading.Event()

    def archive_held_open() -> Any:
        with transaction.atomic():
            counts = history.archive(now=later)
            moved.set()
            release.wait(60)
        return counts

    archiver = Background(archive_held_open)
    assert moved.wait(30)
    replayer = Background(lambda: queue.replay([pk], by="alice"))
    wait_for(
        lambda: lock_waiters("%FOR UPDATE%") == 1, what="the replay to wait on the row", timeout=30
    )
    release.set()
    assert archiver.result() == {"failed": (1, 1)}
    report = replayer.result()

    accounted = report.replayed + report.not_failed + report.key_taken
    assert pk in accounted, f"replay reported nothing about {pk}: {report}; row in {where(pk)}"
    assert report.replayed == (pk,)


@pytest.mark.django_db
def test_replay_of_an_archived_succeeded_job_reports_it_not_failed():
    """``ReplayReport.not_failed`` names a succeeded row that sits in the history.

    replay([id of a succeeded job]) reports it as not_failed whichever table holds it: the
    report's query reads the history too.
    """
    (pk,) = finish(job())
    history.archive(now=database_now() + MINUTE)
    assert where(pk) == "history"

    report = queue.replay([pk], by="alice")

    assert report.not_failed == (pk,), report


@pytest.mark.parametrize("job_id", [None, "invoice-7"])
def test_replay_brings_a_failed_job_back_from_history_under_its_id(job_id):
    (pk,) = finish(job(job_id), state="failed")
    history.archive(now=database_now() + timedelta(minutes=2))
    assert where(pk) == "history"

    report = queue.replay([pk], by="alice")

    assert report.replayed == (pk,)
    assert where(pk) == "jobs"
    row = Job.objects.get(pk=pk)
    # Only a key the caller chose is held again.
    held = job_id is not None
    assert (row.state, row.attempts, row.replayed_by, row.key_held) == ("queued", 0, "alice", held)
    assert queue.replay([pk], by="bob").replayed == ()  # a second replay acts on nothing


def test_the_history_table_replays_through_the_monitor_contract():
    (pk,) = finish(job(), state="failed")
    history.archive(now=database_now() + timedelta(minutes=1))
    table = next(t for t in run_tables() if t.model is JobHistory)
    assert table.supports_replay and table.replay_permission == "jobs.replay_job"
    assert table.eligible_pks([pk]) == [pk]

    page = fetch_page([table], Filters(state="failed"))
    assert [row.pk for row in page.rows] == [pk]

    assert table.replay([pk], by="carol") == 1
    assert where(pk) == "jobs"


def test_a_replay_whose_key_was_taken_leaves_the_newer_job_alone():
    (pk,) = finish(job("import-9"), state="failed")
    history.archive(now=database_now() + timedelta(minutes=2))
    newer = queue.enqueue(job("import-9"))
    assert newer.created

    report = queue.replay([pk], by="dave")

    assert report.key_taken == (pk,)
    assert Job.objects.get(pk=newer.id).state == "queued"


def test_replay_requeues_a_failed_job_with_fresh_attempts():
    failed = JobFactory(failed=True, attempts=5)

    report = queue.replay([failed.pk], by="alice")

    assert report.replayed == (failed.pk,)
    row = Job.objects.get(pk=failed.pk)
    assert (row.state, row.attempts, row.replayed_by, row.key_held) == ("queued", 0, "alice", True)
    assert row.replayed_at is not None and row.finished_at is None
    assert row.last_error == "handler_error"  # why it failed, until it runs again


def test_replay_leaves_active_and_succeeded_jobs_alone():
    queued = JobFactory()
    done = JobFactory(succeeded=True)
    report = queue.replay([queued.pk, done.pk], by="alice")
    assert report.replayed == () and report.not_failed == (queued.pk, done.pk)


def test_replay_after_the_key_was_taken_by_new_work_is_refused():
    old = JobFactory(job_id="k", failed=True, key_held=False)
    new = queue.enqueue(NewJob("test.noop.v1", job_id="k"))

    report = queue.replay([old.pk], by="alice")

    assert report.key_taken == (old.pk,)
    assert Job.objects.get(pk=old.pk).state == "failed"
    assert Job.objects.get(pk=new.id).state == "queued"


def test_replay_takes_the_key_back_from_an_expired_holder():
    old = JobFactory(job_id="k", failed=True, key_held=False)
    newer = JobFactory(job_id="k", succeeded=True, finished_at=timezone.now() - timedelta(days=2))

    assert queue.replay([old.pk], by="alice").replayed == (old.pk,)
    assert Job.objects.get(pk=newer.pk).key_held is False


def test_replay_of_two_failed_rows_sharing_a_key_replays_one():
    first = JobFactory(job_id="k", failed=True, key_held=False)
    second = JobFactory(job_id="k", failed=True, key_held=False)

    report = queue.replay([first.pk, second.pk], by="alice")

    assert report.replayed == (first.pk,)
    assert report.key_taken == (second.pk,)


@pytest.mark.django_db(transaction=True)
def test_two_operators_replaying_at_once_replay_once(threads):
    failed = JobFactory(failed=True)

    reports = threads(2, lambda i: queue.replay([failed.pk], by=f"operator-{i}"))

    assert sorted(len(r.replayed) for r in reports) == [0, 1]
    assert Job.objects.get(pk=failed.pk).state == "queued"
