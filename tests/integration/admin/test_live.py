"""The server's side of the console's live refresh: the same page, never cached, messages kept.

A live request (``X-Jobs-Live: 1``) gets the page an operator would get, with the regions the
script swaps; the response varies on the header and is never cached; and a message waiting
for the operator's next page is not used up by a refresh that shows none.
"""

from __future__ import annotations

import pytest

from jobs.runs import RunState
from tests.support.admin import VIEW_ALL, client_for, operator
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

LIVE = {"HTTP_X_JOBS_LIVE": "1"}


@pytest.fixture
def ops():
    return client_for(operator("ops", *VIEW_ALL, "jobs.cancel_job", "jobs.view_process"))


@pytest.mark.parametrize(
    ("path", "regions"),
    [
        ("/admin/jobs/job/monitor/", ["monitor"]),
        ("/admin/jobs/job/?state__exact=running", ["filters", "results", "pagination"]),
        ("/admin/jobs/process/", ["filters", "results", "pagination"]),
    ],
)
def test_a_live_request_gets_the_page_with_its_regions_uncached(ops, path, regions):
    JobFactory(running=True, job_id="now-running")
    plain = ops.get(path)
    live = ops.get(path, **LIVE)
    assert plain.status_code == live.status_code == 200
    body = live.content.decode()
    for name in regions:
        assert f'data-jobs-live="{name}"' in body
    assert body.count("data-jobs-live-root") == 1  # the control, once
    for response in (plain, live):
        assert "X-Jobs-Live" in response["Vary"]
        assert "no-store" in response["Cache-Control"]


def test_the_live_interval_is_the_setting(ops, settings):
    settings.JOBS = {"LIVE_REFRESH": 2.5}
    assert 'data-jobs-live-interval="2.5"' in ops.get("/admin/jobs/job/monitor/").content.decode()
    settings.JOBS = {}
    assert 'data-jobs-live-interval="5"' in ops.get("/admin/jobs/job/").content.decode()


def test_a_refresh_leaves_the_operators_message_for_their_next_page(ops):
    job = JobFactory(job_id="to-cancel")
    done = ops.post(
        "/admin/jobs/job/",
        {"action": "cancel_selected", "_selected_action": [job.pk], "post": "yes"},
    )
    assert done.status_code == 302
    message = "Cancelled 1 queued job"
    assert message in ops.get("/admin/jobs/job/", **LIVE).content.decode()
    assert message in ops.get("/admin/jobs/job/").content.decode()  # still there to read
    assert message not in ops.get("/admin/jobs/job/").content.decode()  # read once
    job.refresh_from_db()
    assert job.state == RunState.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_a_running_jobs_page_refreshed_as_it_ends_shows_how_it_ended(ops):
    """A job that left for the history as it ended: its page sends the operator there."""
    from jobs import queue
    from jobs.queue import AllTenants, ClaimRequest, Outcome
    from tests.support.history import NAME, job, ready_history

    ready_history()  # a scheduler runs, as in production
    queue.enqueue(job())
    [held] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants(), worker="w")
    page = f"/admin/jobs/job/{held.id}/change/"
    opened = ops.get(page)
    assert opened.status_code == 200 and opened.context["live"], opened.get("Location")
    assert queue.record([Outcome.succeeded(held)]).applied == (held.id,)

    refreshed = ops.get(page, **LIVE)
    # Either the same page with the job's end, or a way to its page in the history.
    history_page = f"/admin/jobs/jobhistory/{held.id}/change/"
    assert (refreshed.status_code, refreshed.get("Location")) == (302, history_page)
    ended = ops.get(history_page)
    assert ended.status_code == 200 and "succeeded" in ended.content.decode()
