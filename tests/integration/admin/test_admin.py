"""The jobs admin: read-only list and detail, cancel and retry-now actions, the overview."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from jobs.admin import actions as admin_actions
from jobs.admin import modeladmin
from jobs.admin.display import moment
from jobs.catalogue.timing import Decision, SlotKind
from jobs.db.clock import database_now
from jobs.models import Job, TenantOverride
from jobs.runs import RunState
from jobs.scheduler import get_schedules, slots
from tests.support.admin import VIEW_ALL, client_for, fast_web_clock, operator
from tests.support.factories import (
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    JobFactory,
)

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:jobs_job_changelist"


@pytest.fixture
def viewer():
    return client_for(operator("viewer", "jobs.view_job"))


@pytest.fixture
def superuser():
    user = User.objects.create_superuser("root", password="x")
    return client_for(user)


def listed(response) -> set[int]:
    return {job.pk for job in response.context["cl"].result_list}


def test_the_list_filters_by_state_type_tenant_and_queue(viewer):
    failed = JobFactory(failed=True, name="jobapp.ping.v1", tenant="acme", queue="pings")
    JobFactory(name="jobapp.ping.v1", tenant="acme")
    JobFactory(failed=True, tenant="globex")

    assert listed(viewer.get(reverse(CHANGELIST), {"state": "failed", "tenant": "acme"})) == {
        failed.pk
    }
    assert failed.pk in listed(viewer.get(reverse(CHANGELIST), {"name": "jobapp.ping.v1"}))
    assert listed(viewer.get(reverse(CHANGELIST), {"queue": "pings"})) == {failed.pk}
    page = viewer.get(reverse(CHANGELIST)).content.decode()
    assert 'name="tenant"' in page and "Failure monitor" in page


def test_the_list_is_read_only(viewer):
    JobFactory()
    page = viewer.get(reverse(CHANGELIST))
    assert page.context["has_add_permission"] is False
    assert "delete_selected" not in page.context["cl"].model_admin.get_actions(page.wsgi_request)


def test_the_detail_page_shows_payload_attempts_error_and_lease(viewer):
    job = JobFactory(
        running=True,
        attempts=2,
        payload={"order_id": 7, "lines": [1, 2]},
        last_error="handler_error",
        error_detail="Traceback (most recent call last):\nValueError: <boom>",
    )

    response = viewer.get(reverse("admin:jobs_job_change", args=[job.pk]))

    page = html.unescape(response.content.decode())
    assert '"order_id": 7' in page and '"lines": [\n    1,' in page  # pretty-printed
    assert "2 / 5" in page and "ValueError: <boom>" in page
    assert "<boom>" not in response.content.decode()  # escaped
    assert "Lease expires at" in page and "Heartbeat at" in page and "Claimed by" in page
    assert 'name="_save"' not in page
    assert viewer.post(reverse("admin:jobs_job_change", args=[job.pk]), {}).status_code == 403


def test_cancel_asks_first_then_ends_queued_and_stops_running_ones_recording_each(superuser):
    queued, running = JobFactory(), JobFactory(running=True)
    finished = JobFactory(succeeded=True)
    data = {"action": "cancel_selected", "_selected_action": [queued.pk, running.pk, finished.pk]}

    page = superuser.post(reverse(CHANGELIST), data)

    assert page.status_code == 200 and page.context["count"] == 2
    assert [n.split(":")[0] for n in page.context["notes"]] == [
        "1 queued job ends cancelled now",
        "1 running job is asked to stop",
    ]
    assert Job.objects.get(pk=queued.pk).state == RunState.QUEUED

    done = superuser.post(reverse(CHANGELIST), {**data, "post": "yes"}, follow=True)

    assert Job.objects.get(pk=queued.pk).state == RunState.CANCELLED
    stopping = Job.objects.get(pk=running.pk)
    assert (stopping.state, stopping.cancel_requested_by) == (RunState.RUNNING, "root")
    assert sorted(e.object_id for e in LogEntry.objects.all()) == sorted(
        [str(queued.pk), str(running.pk)]
    )
    messages = [str(m) for m in done.context["messages"]]
    assert messages == [
        "Cancelled 1 queued job. Asked 1 running job to stop; it ends cancelled within a third "
        "of its lease. 1 selected job was not eligible."
    ]


def test_retry_now_makes_delayed_jobs_due(superuser):
    later = timezone.now() + timedelta(hours=1)
    delayed = JobFactory(run_after=later)
    data = {"action": "run_now_selected", "_selected_action": [delayed.pk], "post": "yes"}

    superuser.post(reverse(CHANGELIST), data)

    assert Job.objects.get(pk=delayed.pk).run_after < later - timedelta(minutes=59)


def test_retry_now_judges_delayed_by_the_database_clock(superuser, monkeypatch):
    """A job due in 3 minutes (PostgreSQL's clock) is still delayed on a host 5 minutes fast."""
    delayed = JobFactory(run_after=database_now() + timedelta(minutes=3))
    fast_web_clock(monkeypatch)
    data = {"action": "run_now_selected", "_selected_action": [delayed.pk]}

    page = superuser.post(reverse(CHANGELIST), data)

    assert page.context["count"] == 1
    superuser.post(reverse(CHANGELIST), {**data, "post": "yes"})
    assert Job.objects.get(pk=delayed.pk).run_after <= database_now()


@pytest.mark.parametrize("action", ["cancel_selected", "run_now_selected"])
def test_select_all_is_bounded_like_replay_all_and_the_page_says_so(superuser, monkeypatch, action):
    monkeypatch.setattr(admin_actions, "ACTION_LIMIT", 3)
    later = database_now() + timedelta(hours=1)
    jobs = [JobFactory(run_after=later) for _ in range(5)]
    select_all = {"action": action, "select_across": "1", "_selected_action": [jobs[0].pk]}

    with CaptureQueriesContext(connection) as ctx:
        page = superuser.post(reverse(CHANGELIST), select_all)

    reads = [q["sql"] for q in ctx.captured_queries if '"jobs_job"' in q["sql"]]
    assert reads and all("LIMIT" in sql for sql in reads)  # no query loads every match
    assert (page.context["count"], page.context["limit"]) == (5, 3)
    assert b"Only the newest 3 jobs are changed at once" in page.content
    newest = sorted(job.pk for job in jobs)[-3:]
    assert sorted(page.context["ids"]) == newest
    assert sorted(job.pk for job in page.context["jobs"]) == newest  # lists what it changes
    assert Job.objects.filter(pk__in=newest, run_after=later, state="queued").count() == 3

    confirmed = {"action": action, "_selected_action": page.context["ids"], "post": "yes"}
    superuser.post(reverse(CHANGELIST), confirmed)

    untouched = Job.objects.filter(state="queued", run_after=later)
    assert sorted(untouched.values_list("pk", flat=True)) == sorted(j.pk for j in jobs[:2])
    assert sorted(int(e.object_id) for e in LogEntry.objects.all()) == newest
    assert {e.change_message for e in LogEntry.objects.all()} == {
        "cancel_selected": {"Cancelled via the admin jobs list"},
        "run_now_selected": {"Made due now via the admin jobs list (retry now)"},
    }[action]


def test_a_confirming_post_over_select_all_is_asked_again(superuser):
    """The confirmation names its rows; "post=yes" over a whole filter is not a confirmation."""
    queued = JobFactory()
    crafted = {"action": "cancel_selected", "select_across": "1", "post": "yes"}

    page = superuser.post(reverse(CHANGELIST), {**crafted, "_selected_action": [queued.pk]})

    assert page.status_code == 200 and page.context["ids"] == [queued.pk]
    assert Job.objects.get(pk=queued.pk).state == RunState.QUEUED
    assert not LogEntry.objects.exists()


@pytest.fixture
def admin_log_refused():
    """PostgreSQL refuses every admin log entry (a full disk, a lost privilege…)."""
    with connection.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION refuse_log() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'admin log refused'; END $$"
        )
        cur.execute(
            "CREATE TRIGGER refuse_log BEFORE INSERT ON django_admin_log "
            "FOR EACH ROW EXECUTE FUNCTION refuse_log()"
        )
    yield
    with connection.cursor() as cur:
        cur.execute("DROP TRIGGER refuse_log ON django_admin_log")
        cur.execute("DROP FUNCTION refuse_log()")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["cancel_selected", "run_now_selected"])
def test_no_change_without_its_log_entry(superuser, admin_log_refused, action):
    later = database_now() + timedelta(hours=1)
    job = JobFactory(run_after=later)
    data = {"action": action, "_selected_action": [job.pk], "post": "yes"}

    with pytest.raises(DatabaseError, match="admin log refused"):
        superuser.post(reverse(CHANGELIST), data)

    assert Job.objects.filter(pk=job.pk, state=RunState.QUEUED, run_after=later).exists()


def test_actions_need_their_permission(viewer):
    queued = JobFactory()
    data = {"action": "cancel_selected", "_selected_action": [queued.pk], "post": "yes"}

    viewer.post(reverse(CHANGELIST), data)

    assert Job.objects.get(pk=queued.pk).state == RunState.QUEUED
    actions = viewer.get(reverse(CHANGELIST)).context["cl"].model_admin.get_actions
    assert actions(viewer.get(reverse(CHANGELIST)).wsgi_request) == {}


def test_the_list_counts_at_most_the_cap(viewer, monkeypatch):
    monkeypatch.setattr(modeladmin, "MAX_ROWS", 2)
    for _ in range(3):
        JobFactory()
    assert viewer.get(reverse(CHANGELIST)).context["cl"].result_count == 2


def test_the_overview_counts_states_and_types_and_names_unsupported_ones(viewer):
    JobFactory(name="jobapp.ping.v1")
    JobFactory(name="jobapp.ping.v1", run_after=timezone.now() - timedelta(minutes=90))
    JobFactory(failed=True, name="jobapp.ping.v1")
    JobFactory(name="gone.away.v1")

    with CaptureQueriesContext(connection) as ctx:
        response = viewer.get(reverse("admin:jobs_overview"))

    assert response.status_code == 200
    states = {state["value"]: state["total"] for state in response.context["states"]}
    assert states["queued"] == "3" and states["failed"] == "1" and response.context["total"] == "4"
    types = {row["name"]: row for row in response.context["types"]}
    assert (types["jobapp.ping.v1"]["queued"], types["jobapp.ping.v1"]["failed"]) == ("2", "1")
    assert types["gone.away.v1"]["registered"] is False
    [(name, count, _url)] = response.context["unsupported"]
    assert (name, count) == ("gone.away.v1", "1")
    assert response.context["oldest_due_age"] in {"1h", "90m"}
    assert len(ctx.captured_queries) < 17  # a fixed handful, whatever the tables hold


def test_the_overview_says_which_counts_are_estimates(viewer):
    """Past the backlog cap a type's queued count is an estimate and its due count a floor;
    the queued rows are read only by the bounded backlog statement."""
    with connection.cursor() as cur:
        cur.execute(
            """
            INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts,
                                  run_after, state, attempts, last_error, error_detail,
                                  claimed_by, key_held, replayed_by, created_at)
            SELECT 'bulk-' || g, 'jobapp.ping.v1', '{}', 'default', 'default', 0, 5,
                   now() - interval '1 minute', 'queued', 0, '', '', '', TRUE, '', now()
            FROM generate_series(1, 1050) AS g
            """
        )
    JobFactory(name="gone.away.v1")

    with CaptureQueriesContext(connection) as ctx:
        response = viewer.get(reverse("admin:jobs_overview"))

    types = {row["name"]: row for row in response.context["types"]}
    assert types["jobapp.ping.v1"]["queued"].startswith("≈")
    assert types["jobapp.ping.v1"]["due"] == "1,000+"
    assert (types["gone.away.v1"]["queued"], types["gone.away.v1"]["due"]) == ("1", "1")
    states = {state["value"]: state["total"] for state in response.context["states"]}
    assert states["queued"].startswith("≈") and response.context["total"].startswith("≈")
    assert "1,000+" in response.content.decode()
    reading_queued = [
        q["sql"] for q in ctx.captured_queries if "jobs_job" in q["sql"] and "queued" in q["sql"]
    ]
    bounded = ("WITH RECURSIVE", "EXPLAIN", "NOT")  # the backlog, its estimate, the others
    assert all(any(word in sql for word in bounded) for sql in reading_queued), reading_queued


def test_the_overview_judges_overdue_schedules_by_the_database_clock(viewer, monkeypatch):
    [digest] = get_schedules()  # the demo's every-minute schedule
    now = database_now()
    with connection.cursor() as cur:  # its slot of this minute fired just now
        slot = now.replace(second=0, microsecond=0)
        slots.record(cur, digest.name, Decision(slot, SlotKind.ON_TIME), job_id="x", by="test")
    JobFactory(run_after=now - timedelta(minutes=2))
    fast_web_clock(monkeypatch)

    response = viewer.get(reverse("admin:jobs_overview"))

    assert response.context["schedules"] == []
    assert response.context["oldest_due_age"] == "2m"


def test_the_overview_needs_the_jobs_view_permission():
    mail_only = client_for(operator("postmaster", "mail.view_delivery"))
    assert mail_only.get(reverse("admin:jobs_overview")).status_code == 403


def test_the_overview_admits_whoever_the_jobs_list_admits():
    """As in the admin, the change permission includes viewing."""
    changer = client_for(operator("changer", "jobs.change_job"))

    assert changer.get(reverse(CHANGELIST)).status_code == 200
    assert changer.get(reverse("admin:jobs_overview")).status_code == 200
    assert reverse("admin:jobs_overview") in changer.get(reverse(CHANGELIST)).content.decode()


def test_tenant_overrides_are_added_but_never_moved(superuser):
    superuser.post(
        reverse("admin:jobs_tenantoverride_add"),
        {"tenant": "acme", "component": "worker", "note": "branch"},
    )
    override = TenantOverride.objects.get()
    page = superuser.get(reverse("admin:jobs_tenantoverride_change", args=[override.pk]))
    assert 'name="tenant"' not in page.content.decode()  # read-only once it exists


def test_every_example_table_has_a_read_only_admin(superuser):
    rows = {
        "mail_delivery": DeliveryFactory(),
        "harvester_deadletter": DeadLetterFactory(),
        "curation_curationrun": CurationRunFactory(),
    }
    for name, row in rows.items():
        listing = superuser.get(reverse(f"admin:{name}_changelist"))
        assert listing.status_code == 200
        detail = superuser.get(reverse(f"admin:{name}_change", args=[row.pk]))
        assert 'id="replay-row"' in detail.content.decode()
    runs = superuser.get(reverse("admin:curation_curationrun_changelist"))
    assert "attempts" not in runs.context["cl"].list_display  # the table has none


def test_the_admin_pages_link_to_the_monitor():
    admin = client_for(operator("root", *VIEW_ALL))
    for url in (reverse("admin:index"), reverse("admin:app_list", args=["jobs"])):
        assert reverse("admin:jobs_monitor") in admin.get(url).content.decode()


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
