"""A job and the run row it drives read as one failure: one line in the monitor, linked pages.

The bound type is ``runapp.deliver.v1`` (registered process-wide by ``tests/runapp/jobs.py``):
its payload's ``run_id`` names a ``runapp.delivery`` row.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.urls import reverse

from jobs import enqueue
from jobs.catalogue.registry import Registry, get_registry
from jobs.control import links
from jobs.control.failures import eligible_rows, fetch_page
from jobs.control.replays import replay
from jobs.control.tables import Filters, RunTable, run_tables
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory
from jobs.queue import history
from jobs.runs import ErrorCode, RunState
from jobs.testing import JobFailed, run_worker
from tests.runapp.jobs import DeliverV1
from tests.runapp.models import Delivery
from tests.support.admin import client_for, operator
from tests.support.factories import JobFactory, ago

pytestmark = pytest.mark.django_db

BOUND = "runapp.deliver.v1"
SEES_BOTH = ("jobs.view_job", "runapp.view_delivery")


def failed_pair(minutes: float = 1, **job) -> tuple[Job, Delivery]:
    """A failed delivery row and the failed job that drove it, as the binding leaves them."""
    row = Delivery.objects.create(
        job_id=f"d-{minutes}",
        state=RunState.FAILED,
        last_error=ErrorCode.HANDLER_ERROR,
        finished_at=ago(minutes=minutes),
    )
    Delivery.objects.filter(pk=row.pk).update(created_at=ago(minutes=minutes + 1))
    made = JobFactory(
        failed=True, name=BOUND, payload={"run_id": row.pk}, finished_at=ago(minutes=minutes), **job
    )
    return made, row


def tokens(rows) -> list[str]:
    return [row.token for row in rows]


def test_a_failed_job_and_its_failed_run_row_are_one_line_counted_once():
    job, row = failed_pair()
    lone = Delivery.objects.create(
        job_id="d-lone", state=RunState.FAILED, finished_at=ago(minutes=2)
    )

    page = fetch_page(run_tables(), Filters())

    assert tokens(page.rows) == [f"jobs.job:{job.pk}", f"runapp.delivery:{lone.pk}"]
    assert (page.counts["jobs.job"], page.counts["runapp.delivery"], page.total) == (1, 1, 2)
    assert "runapp.delivery" in page.folded
    found = links.links_for(page.rows, run_tables())
    assert found[f"jobs.job:{job.pk}"].token == f"runapp.delivery:{row.pk}"
    assert found[f"jobs.job:{job.pk}"].state == RunState.FAILED
    assert f"runapp.delivery:{lone.pk}" not in found  # no job drives it


def test_the_run_row_shows_with_its_job_link_when_the_job_is_not_listed():
    job, row = failed_pair()

    for filters in (Filters(module="runapp.delivery"), Filters(q=row.job_id)):
        page = fetch_page(run_tables(), filters)
        assert tokens(page.rows) == [f"runapp.delivery:{row.pk}"], filters
        found = links.links_for(page.rows, run_tables())
        assert found[f"runapp.delivery:{row.pk}"].token == f"jobs.job:{job.pk}"


def test_a_user_who_may_not_see_jobs_sees_the_run_row_without_a_job_link():
    _job, row = failed_pair()
    tables = [t for t in run_tables() if t.label == "runapp.delivery"]

    page = fetch_page(tables, Filters())

    assert tokens(page.rows) == [f"runapp.delivery:{row.pk}"]
    assert links.links_for(page.rows, tables) == {}


def test_a_job_in_the_history_folds_its_run_row_too():
    job, row = failed_pair()
    Job.objects.filter(pk=job.pk).update(key_held=False)
    history.archive(now=database_now() + timedelta(minutes=2))
    assert JobHistory.objects.filter(pk=job.pk).exists()

    page = fetch_page(run_tables(), Filters())

    assert tokens(page.rows) == [f"jobs.jobhistory:{job.pk}"]
    found = links.links_for(page.rows, run_tables())
    assert found[f"jobs.jobhistory:{job.pk}"].token == f"runapp.delivery:{row.pk}"
    table = next(t for t in run_tables() if t.label == "runapp.delivery")
    assert links.link_of(table, row.pk, run_tables()).token == f"jobs.jobhistory:{job.pk}"


def test_rows_of_other_jobs_or_states_are_not_folded():
    job, _row = failed_pair()
    other = Delivery.objects.create(
        job_id="d-other", state=RunState.FAILED, finished_at=ago(minutes=3)
    )
    JobFactory(succeeded=True, name=BOUND, payload={"run_id": other.pk})  # not a listed failure
    unbound = JobFactory(failed=True, name="test.noop.v1", payload={"run_id": other.pk})

    page = fetch_page(run_tables(), Filters())

    assert set(tokens(page.rows)) == {
        f"jobs.job:{job.pk}",
        f"jobs.job:{unbound.pk}",
        f"runapp.delivery:{other.pk}",
    }
    assert page.total == 3


def test_replay_all_takes_the_job_which_requeues_its_row():
    job, row = failed_pair()
    alice = operator("alice", *SEES_BOTH, "jobs.replay_job", "runapp.replay_delivery")

    rows, matching, _capped = eligible_rows(run_tables(), Filters(), 500)

    assert (tokens(rows), matching) == ([f"jobs.job:{job.pk}"], 1)
    (done,) = replay(alice, {rows[0].table: [job.pk]}, via="test")
    assert done.replayed == (job.pk,)
    row.refresh_from_db()
    assert (Job.objects.get(pk=job.pk).state, row.state) == (RunState.QUEUED, RunState.QUEUED)


def test_the_fold_is_one_anti_join_not_a_query_per_row():
    for minute in range(5):
        failed_pair(minutes=minute + 1)
    table = next(t for t in run_tables() if t.label == "runapp.delivery")
    jobs_table = next(t for t in run_tables() if t.label == "jobs.job")
    [(_t, qs), _jobs] = links.fold(
        [(table, table.filtered(Filters())), (jobs_table, jobs_table.filtered(Filters()))]
    )
    sql, params = qs.query.sql_with_params()
    with connection.cursor() as cur:
        cur.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(line for (line,) in cur.fetchall())

    assert "Anti Join" in plan and "SubPlan" not in plan, plan


def test_the_job_page_links_to_its_run_row_and_back():
    job, row = failed_pair()
    admin = client_for(operator("ops", *SEES_BOTH))

    job_page = admin.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()
    row_url = reverse("admin:runapp_delivery_change", args=[row.pk])
    assert f'href="{row_url}"' in job_page and 'id="linked-work"' in job_page

    row_page = admin.get(row_url).content.decode()
    assert f'href="{reverse("admin:jobs_job_change", args=[job.pk])}"' in row_page


def test_a_page_links_only_to_a_table_its_reader_may_view():
    job, _row = failed_pair()
    jobs_only = client_for(operator("jobs-only", "jobs.view_job"))

    page = jobs_only.get(reverse("admin:jobs_job_change", args=[job.pk])).content.decode()

    assert 'id="linked-work"' not in page


def test_the_monitor_shows_the_run_row_on_its_jobs_line():
    job, row = failed_pair()
    admin = client_for(operator("ops", *SEES_BOTH))

    page = admin.get(reverse("admin:jobs_monitor"))

    html = page.content.decode()
    assert f'data-row="jobs.job:{job.pk}"' in html
    assert f'data-row="runapp.delivery:{row.pk}"' not in html
    assert reverse("admin:runapp_delivery_change", args=[row.pk]) in html
    assert 'class="jobs-folded"' in html  # the summary says why the row has no line


@pytest.mark.django_db(transaction=True)
def test_a_job_the_worker_failed_and_its_row_read_as_one_failure():
    row = Delivery.objects.create(job_id="d-worker")
    enqueue(DeliverV1(run_id=row.pk, plan=("error", "error", "error")))

    with pytest.raises(JobFailed):
        run_worker(registry=Registry([get_registry()[BOUND]]))

    row.refresh_from_db()
    job = Job.objects.get(name=BOUND)
    assert (row.state, job.state) == (RunState.FAILED, RunState.FAILED)
    page = fetch_page(run_tables(), Filters())
    assert tokens(page.rows) == [f"jobs.job:{job.pk}"]
    table = RunTable(Delivery)
    assert links.link_of(table, row.pk, run_tables()).token == f"jobs.job:{job.pk}"


def test_the_replay_confirmation_names_the_run_row_the_job_requeues():
    job, row = failed_pair()
    admin = client_for(operator("ops", *SEES_BOTH, "jobs.replay_job"))

    page = admin.get(reverse("admin:jobs_monitor_replay"), {"rows": f"jobs.job:{job.pk}"})

    assert page.status_code == 200
    assert reverse("admin:runapp_delivery_change", args=[row.pk]) in page.content.decode()
