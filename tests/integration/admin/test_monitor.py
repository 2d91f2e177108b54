"""The failure monitor: merging run tables, paginating, filtering, grouping, bounded queries."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.control import failures
from jobs.control.failures import failure_groups, fetch_page
from jobs.control.tables import Filters, run_tables, summarize
from jobs.db.clock import database_now
from jobs.runs import ErrorCode, RunState, run_contract_models
from tests.support.admin import VIEW_ALL, client_for, fast_web_clock, operator
from tests.support.factories import (
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    JobFactory,
    ago,
)

pytestmark = pytest.mark.django_db

MONITOR = "admin:jobs_monitor"


def tokens(rows):
    return [row.token for row in rows]


def test_every_concrete_run_table_is_discovered():
    labels = [table.label for table in run_tables()]
    assert labels == sorted(model._meta.label_lower for model in run_contract_models())
    assert {"curation.curationrun", "harvester.deadletter", "jobs.job", "mail.delivery"} <= set(
        labels
    )


def test_rows_from_four_tables_merge_newest_failure_first():
    job = JobFactory(failed=True, finished_at=ago(minutes=1))
    delivery = DeliveryFactory(finished_at=ago(minutes=2))
    dead = DeadLetterFactory(finished_at=ago(minutes=3))
    run = CurationRunFactory(finished_at=ago(minutes=4))
    old_job = JobFactory(failed=True, finished_at=ago(minutes=5))
    JobFactory(succeeded=True)  # not a failure: left out by the default filter

    page = fetch_page(run_tables(), Filters())

    assert tokens(page.rows) == [
        f"jobs.job:{job.pk}",
        f"mail.delivery:{delivery.pk}",
        f"harvester.deadletter:{dead.pk}",
        f"curation.curationrun:{run.pk}",
        f"jobs.job:{old_job.pk}",
    ]
    assert {
        "curation.curationrun": 1,
        "harvester.deadletter": 1,
        "jobs.job": 2,
        "mail.delivery": 1,
    }.items() <= page.counts.items()
    first = page.rows[0]
    assert (first.job_type, first.tenant, first.attempts, first.error) == (
        "test.noop.v1",
        "default",
        5,
        "handler_error",
    )
    by_table = {row.table.label: row for row in page.rows}
    assert by_table["mail.delivery"].job_type == "mail.deliver.v1"  # the table's fixed type
    assert by_table["mail.delivery"].tenant == ""  # no tenant column
    assert by_table["curation.curationrun"].attempts is None  # the table dropped the field


def test_pages_cut_the_merge_without_gaps_or_repeats():
    made = []
    for minute in range(1, 8):
        factory = [JobFactory, DeliveryFactory, DeadLetterFactory][minute % 3]
        extra = {"failed": True} if factory is JobFactory else {}
        made.append(factory(finished_at=ago(minutes=minute), **extra))

    pages = [fetch_page(run_tables(), Filters(), n, per_page=3) for n in (1, 2, 3)]

    assert [page.num_pages for page in pages] == [3, 3, 3]
    assert [len(page.rows) for page in pages] == [3, 3, 1]
    everything = tokens(fetch_page(run_tables(), Filters(), per_page=50).rows)
    assert [token for page in pages for token in tokens(page.rows)] == everything
    assert len(set(everything)) == 7
    assert fetch_page(run_tables(), Filters(), 99, per_page=3).number == 3  # clamped


def test_each_table_is_read_with_a_bounded_query():
    for _ in range(3):
        JobFactory(failed=True)
        DeliveryFactory()

    with CaptureQueriesContext(connection) as ctx:
        fetch_page(run_tables(), Filters(), 1, per_page=2)

    selects = [q["sql"] for q in ctx.captured_queries]
    # A capped count per table; rows only from the two tables that have any.
    tables = len(run_tables())
    assert len(selects) == tables + 2
    assert all("LIMIT" in sql for sql in selects)
    assert sum(sql.startswith("SELECT COUNT(*)") for sql in selects) == tables


def test_the_monitor_page_runs_the_same_queries_for_few_or_many_rows():
    admin = client_for(operator("root", *VIEW_ALL))

    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin.get(reverse(MONITOR)).status_code == 200
        return len(ctx.captured_queries)

    JobFactory(failed=True)
    DeliveryFactory()
    DeadLetterFactory()
    CurationRunFactory()
    few = queries()
    for _ in range(10):
        JobFactory(failed=True)
        DeliveryFactory()
        DeadLetterFactory()
        CurationRunFactory()
    assert queries() == few  # no query per row


def test_counts_stop_at_the_cap(monkeypatch):
    monkeypatch.setattr(failures, "MAX_ROWS", 3)
    for _ in range(5):
        DeliveryFactory()

    page = fetch_page(run_tables(), Filters(), per_page=2)

    assert page.counts["mail.delivery"] == 3 and page.capped
    assert page.num_pages == 2


def test_filters_by_module_state_error_and_job_id():
    failed = DeliveryFactory(job_id="welcome-7", last_error=ErrorCode.HANDLER_ERROR)
    DeliveryFactory(job_id="invoice-8")
    queued = DeliveryFactory(job_id="welcome-9", state=RunState.QUEUED, finished_at=None)
    JobFactory(failed=True, job_id="welcome-10")

    def labels(**filters):
        return tokens(fetch_page(run_tables(), Filters(**filters)).rows)

    assert labels(module="mail.delivery", q="welcome") == [f"mail.delivery:{failed.pk}"]
    assert labels(module="mail.delivery", state=RunState.QUEUED) == [f"mail.delivery:{queued.pk}"]
    assert labels(error=ErrorCode.HANDLER_ERROR) != []
    assert set(labels(error=ErrorCode.HANDLER_ERROR)) == {
        f"mail.delivery:{failed.pk}",
        *[f"jobs.job:{pk}" for pk in _job_pks()],
    }
    assert len(labels(state="")) == 4  # every state


def test_job_type_and_tenant_filters_leave_out_tables_that_cannot_answer():
    job = JobFactory(failed=True, name="mail.deliver.v1", tenant="acme")
    JobFactory(failed=True, name="other.thing.v1", tenant="acme")
    delivery = DeliveryFactory()
    DeadLetterFactory()

    by_type = tokens(fetch_page(run_tables(), Filters(job_type="mail.deliver.v1")).rows)
    by_tenant = tokens(fetch_page(run_tables(), Filters(tenant="acme")).rows)

    assert sorted(by_type) == sorted([f"jobs.job:{job.pk}", f"mail.delivery:{delivery.pk}"])
    assert all(token.startswith("jobs.job:") for token in by_tenant) and len(by_tenant) == 2


def test_age_counts_from_when_the_row_failed():
    recent = DeliveryFactory(finished_at=ago(minutes=50))
    DeliveryFactory(finished_at=ago(minutes=70))

    rows = fetch_page(run_tables(), Filters(age=timedelta(hours=1))).rows

    assert tokens(rows) == [f"mail.delivery:{recent.pk}"]


def test_every_row_links_to_its_own_admin_page():
    JobFactory(failed=True)
    DeliveryFactory()
    DeadLetterFactory()
    CurationRunFactory()
    admin = client_for(operator("root", *VIEW_ALL))

    rows = fetch_page(run_tables(), Filters()).rows

    assert len(rows) == 4
    for row in rows:
        assert row.admin_url.endswith(f"/{row.pk}/change/")
        assert admin.get(row.admin_url).status_code == 200


def test_the_monitor_page_shows_rows_and_sidebar_filters():
    JobFactory(failed=True, job_id="invoice-42")
    DeliveryFactory(job_id="welcome-1")
    admin = client_for(operator("root", *VIEW_ALL))

    page = admin.get(reverse(MONITOR), {"q": "invoice"}).content.decode()

    assert "invoice-42" in page and "welcome-1" not in page
    assert "?q=invoice&amp;module=mail.delivery" in page  # filter links keep the search


def test_anonymous_users_are_sent_to_log_in(client):
    response = client.get(reverse(MONITOR))
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_staff_without_view_permissions_are_refused():
    response = client_for(operator("nobody")).get(reverse(MONITOR))
    assert response.status_code == 403


def test_staff_see_only_the_tables_they_may_view():
    JobFactory(failed=True, job_id="secret-job")
    DeliveryFactory(job_id="welcome-1")
    mail_only = client_for(operator("postmaster", "mail.view_delivery"))

    page = mail_only.get(reverse(MONITOR)).content.decode()

    assert "welcome-1" in page and "secret-job" not in page
    assert "Replay" not in page  # may view, may not replay


def test_failures_grouped_by_cause_and_job_type_per_window():
    for minutes in (30, 300, 3 * 24 * 60, 8 * 24 * 60):
        DeliveryFactory(finished_at=ago(minutes=minutes))
    JobFactory(failed=True, name="mail.deliver.v1", finished_at=ago(minutes=5))
    DeliveryFactory(finished_at=ago(minutes=5), last_error=ErrorCode.HANDLER_ERROR)

    by_cause, by_type = failure_groups(run_tables())

    causes = {(g.module, g.key): g.counts for g in by_cause}
    assert causes[("mail.delivery", "rejected")] == {"1h": 1, "24h": 2, "7d": 3}
    assert causes[("mail.delivery", "handler_error")] == {"1h": 1, "24h": 1, "7d": 1}
    assert causes[("jobs.job", "handler_error")] == {"1h": 1, "24h": 1, "7d": 1}
    types = {(g.module, g.key): g for g in by_type}
    assert types[("mail.delivery", "mail.deliver.v1")].counts == {"1h": 2, "24h": 3, "7d": 4}
    assert types[("jobs.job", "mail.deliver.v1")].counts["1h"] == 1
    first = types[("mail.delivery", "mail.deliver.v1")].first
    assert timedelta(days=2) < (ago() - first) < timedelta(days=4)  # since when
    assert by_cause[0].counts["1h"] >= by_cause[-1].counts["1h"]  # recent trouble first


def test_grouped_view_links_each_count_to_the_filtered_monitor():
    DeliveryFactory(finished_at=ago(minutes=5))
    admin = client_for(operator("root", *VIEW_ALL))

    page = admin.get(reverse("admin:jobs_monitor_groups")).content.decode()

    assert "module=mail.delivery&amp;error=rejected&amp;state=failed&amp;age=1h" in page


def test_a_traceback_is_summarized_by_its_last_line():
    detail = 'Traceback (most recent call last):\n  File "x.py"\nproject.mail.transport.Boom: no'
    assert summarize(detail, detail) == "Boom: no"
    assert summarize("550 refused\nmore", "more") == "550 refused"
    assert summarize("", "") == ""


def _job_pks():
    from jobs.models import Job

    return Job.objects.filter(last_error=ErrorCode.HANDLER_ERROR).values_list("pk", flat=True)


def test_system_checks_pass_for_the_project_and_name_a_missing_permission(monkeypatch):
    from jobs.control.checks import check_run_tables
    from project.mail.models import Delivery

    assert check_run_tables() == []
    monkeypatch.setattr(Delivery._meta, "permissions", [])
    [error] = check_run_tables()
    assert error.id == "jobs.E030" and "replay_delivery" in error.msg


def test_ages_are_measured_on_the_database_clock(monkeypatch):
    """A failure recorded two minutes ago (PostgreSQL's clock) is "2m" on a fast web host."""
    DeliveryFactory(job_id="welcome-1", finished_at=database_now() - timedelta(minutes=2))
    admin = client_for(operator("root", *VIEW_ALL))
    fast_web_clock(monkeypatch)

    monitor = admin.get(reverse(MONITOR))
    [line] = admin.get(reverse("admin:jobs_monitor_groups")).context["sections"][0]["lines"]

    assert [item["age"] for item in monitor.context["rows"]] == ["2m"]
    assert (line["first"], line["last"]) == ("2m", "2m")


def test_a_system_check_refuses_two_tables_with_one_label(monkeypatch):
    """Replay tokens and the module filter name tables by label: one label, one table."""
    from jobs.control.checks import check_run_tables
    from project.curation.models import CurationRun

    monkeypatch.setattr(CurationRun, "monitor_label", "mail.delivery")
    [error] = check_run_tables()

    assert error.id == "jobs.E032" and "'mail.delivery'" in error.msg
    assert "project.mail.models.Delivery" in error.msg
    assert "project.curation.models.CurationRun" in error.msg
