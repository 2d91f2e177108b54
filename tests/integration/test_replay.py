"""Replay from the admin and the command: confirmation, permissions, CSRF, records, idempotency."""

from __future__ import annotations

import re
import threading

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.test import Client
from django.urls import reverse

from jobs.models import Job
from jobs.monitor import modeladmin, views
from jobs.runs import RunState
from project.curation.models import CurationRun
from project.harvester.models import DeadLetter
from project.mail.models import Delivery
from tests.support.admin import REPLAY_ALL, VIEW_ALL, client_for, operator
from tests.support.factories import (
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    JobFactory,
    ago,
)
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
