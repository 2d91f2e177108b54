"""End to end in headless Chromium: an operator finds a failed job in the monitor, replays it,
follows a job to the run row it drives and back, pauses and resumes a job type, cancels a
running job and reads its attempts, and looks at the live processes.

Drives the real admin on a live server with Playwright and Debian's Chromium
(``scripts/test`` installs it when it can). Saves ``tests/artifacts/monitor.png``; with
``JOBS_UPDATE_SCREENSHOTS=1`` it also rewrites the screenshots in ``docs/images/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry

from jobs import queue
from jobs.models import Job, Pause
from jobs.runs import RunState
from tests.runapp.models import Delivery as RunDelivery
from tests.support.admin import REPLAY_ALL, VIEW_ALL, operator
from tests.support.browser import TIMEOUT_MS, WORKER, log_in, seed_processes, shot
from tests.support.factories import (
    CurationRunFactory,
    DeadLetterFactory,
    DeliveryFactory,
    JobFactory,
    ago,
    two_attempts,
)

pytestmark = pytest.mark.django_db(transaction=True)

ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "monitor.png"


def test_an_operator_replays_a_failed_job_from_the_monitor(live_server, browser, monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the ORM calls here are plain
    # synchronous test code, not code running inside that loop.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator("ops", *VIEW_ALL, *REPLAY_ALL, password="correct horse")
    job = JobFactory(failed=True, job_id="invoice-42", finished_at=ago(minutes=3))
    JobFactory(failed=True, job_id="report-7", finished_at=ago(minutes=9))
    DeliveryFactory(job_id="welcome-ann", finished_at=ago(minutes=1))
    DeadLetterFactory(finished_at=ago(minutes=5))
    CurationRunFactory(finished_at=ago(minutes=7))
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)

    page.goto(f"{live_server.url}/admin/login/?next=/admin/jobs/job/monitor/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 5  # four tables merged

    page.click("#changelist-filter a:text-is('jobs.job')")
    page.wait_for_url("**module=jobs.job**")
    assert page.locator("#result_list tbody tr").count() == 2
    row = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    row.locator("a.jobs-replay").click()

    page.wait_for_selector("#confirm-replay")
    assert "invoice-42" in page.inner_text("#content-main")
    page.click("#confirm-replay")

    page.wait_for_selector(".messagelist")
    assert "Replayed 1 row (1 jobs.job)." in page.inner_text(".messagelist")
    assert page.locator(f"tr[data-row='jobs.job:{job.pk}']").count() == 0  # not failed now
    page.click("#changelist-filter a:text-is('Queued')")
    page.wait_for_url("**state=queued**")
    queued = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    assert queued.locator("td.jobs-state").inner_text() == "queued"
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACT), full_page=True)
    print(f"\nscreenshot: {ARTIFACT}")

    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.replayed_by) == (RunState.QUEUED, "ops")
    assert LogEntry.objects.filter(object_id=str(job.pk)).count() == 1


def test_an_operator_reads_a_job_and_its_run_row_as_one_failure(live_server, browser, monkeypatch):
    """The monitor shows a bound job and its run row on one line; their pages link each way."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator("ops", "jobs.view_job", "runapp.view_delivery", password="correct horse")
    row = RunDelivery.objects.create(
        job_id="welcome-bob", state=RunState.FAILED, finished_at=ago(minutes=2)
    )
    RunDelivery.objects.filter(pk=row.pk).update(created_at=ago(minutes=3))
    job = JobFactory(
        failed=True,
        name="runapp.deliver.v1",
        payload={"run_id": row.pk},
        finished_at=ago(minutes=2),
    )
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)

    page.goto(f"{live_server.url}/admin/login/?next=/admin/jobs/job/monitor/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 1  # one failure, one line
    line = page.locator(f"tr[data-row='jobs.job:{job.pk}']")
    assert "runapp.delivery: 0" in page.inner_text(".jobs-summary")
    assert page.locator(".jobs-folded").count() == 1

    line.locator(f".jobs-link a:text-is('runapp.delivery #{row.pk}')").click()
    page.wait_for_url(f"**/admin/runapp/delivery/{row.pk}/change/")
    assert "This row is driven by job" in page.inner_text("#linked-work")

    page.click(f"#linked-work a:text-is('jobs.job #{job.pk}')")
    page.wait_for_url(f"**/admin/jobs/job/{job.pk}/change/")
    assert f"runapp.delivery #{row.pk}" in page.inner_text("#linked-work")


def test_an_operator_pauses_a_job_type_from_the_overview_and_resumes_it(
    live_server, browser, monkeypatch
):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator(
        "ops", "jobs.view_job", "jobs.pause_work", "jobs.view_process", password="correct horse"
    )
    for _ in range(3):
        JobFactory(name="jobapp.ping.v1")
    JobFactory(name="jobapp.audit.v1", tenant="acme")
    queue.pause("tenant", "acme", by="alice", reason="customer migration")
    seed_processes()
    page = log_in(browser, live_server, "ops", "/admin/jobs/job/overview/")
    assert page.inner_text("#capacity-workers") == "2 live workers"
    assert page.inner_text("#capacity-free") == "3 free slots"

    page.click("tr[data-type='jobapp.ping.v1'] a.jobs-pause")
    page.wait_for_selector("#confirm-pause")
    assert "Its backlog stays queued and keeps growing" in page.inner_text("#pause-effect")
    page.fill("#id_reason", "INC-7: the ping upstream is down")
    shot(page.locator("#content"), "pause-confirmation.png")
    page.click("#confirm-pause")

    page.wait_for_selector(".messagelist")
    assert "Paused job type jobapp.ping.v1" in page.inner_text(".messagelist")
    row = page.locator("tr[data-type='jobapp.ping.v1']")
    assert row.get_attribute("class") == "jobs-paused"
    assert row.locator(".jobs-badge-paused").inner_text() == "paused"
    listed = page.locator("tr[data-pause='job_type:jobapp.ping.v1']")
    assert "INC-7: the ping upstream is down" in listed.inner_text()
    shot(page, "overview-paused.png", down_to="#jobs-per-type")

    listed.locator("a.jobs-resume").click()
    page.wait_for_selector("#confirm-resume")
    page.click("#confirm-resume")
    page.wait_for_selector(".messagelist")
    assert "Resumed job type jobapp.ping.v1" in page.inner_text(".messagelist")
    assert page.locator("tr[data-pause='job_type:jobapp.ping.v1']").count() == 0
    assert page.locator("tr[data-type='jobapp.ping.v1']").get_attribute("class") is None

    assert list(Pause.objects.values_list("kind", "value")) == [("tenant", "acme")]
    assert sorted(LogEntry.objects.values_list("change_message", flat=True)) == [
        "Paused via the admin: INC-7: the ping upstream is down",
        "Resumed via the admin",
    ]


def test_an_operator_cancels_a_running_job_and_reads_its_attempts(
    live_server, browser, monkeypatch
):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator(
        "ops", "jobs.view_job", "jobs.cancel_job", "jobs.view_process", password="correct horse"
    )
    job = JobFactory(
        running=True,
        name="jobapp.ping.v1",
        job_id="invoice-42",
        attempts=3,
        attempt_log=two_attempts(ago(minutes=6)),  # two earlier attempts, then this one
        claimed_by=WORKER,
        started_at=ago(seconds=42),
    )
    seed_processes()
    page = log_in(browser, live_server, "ops", f"/admin/jobs/job/{job.pk}/change/")
    timeline = page.locator("#attempt-timeline tbody")
    assert timeline.count() == 3
    assert timeline.nth(2).locator(".jobs-badge").inner_text() == "running"
    assert "running for" in timeline.nth(2).inner_text()

    page.click("#cancel-job")
    page.wait_for_selector("#confirm-cancel")
    assert "next lease renewal" in page.inner_text("#cancel-effects")
    shot(page.locator("#content"), "cancel-confirmation.png")
    page.click("#confirm-cancel")

    page.wait_for_selector("#cancel-requested")
    page.click("#toggle-nav-sidebar")  # the room a wide timeline needs, as an operator would
    assert "Cancel requested by ops at" in page.inner_text("#cancel-requested")
    assert page.locator("#cancel-job").count() == 0
    page.locator("#attempt-timeline details summary").first.click()  # unfold an error
    assert page.locator("#attempt-timeline details[open]").count() == 1
    shot(page, "job-attempts-cancel.png", down_to="#attempt-timeline")
    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.cancel_requested_by) == (RunState.RUNNING, "ops")
    assert LogEntry.objects.get().change_message == "Asked to stop (running) via the admin job page"

    page.goto(f"{live_server.url}/admin/jobs/job/overview/")
    page.click("#processes-link")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 3
    assert WORKER in page.inner_text("#result_list")
    shot(page, "processes.png")


def test_an_operator_without_the_permissions_sees_no_controls_and_cannot_post(
    live_server, browser, monkeypatch
):
    """A viewer gets no Pause or Cancel controls, and forged POSTs are refused: without the
    permission (403), and without the page's CSRF token (403) even for one who has it."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    operator("viewer", "jobs.view_job", "jobs.view_pause", password="correct horse")
    operator("ops", "jobs.view_job", "jobs.pause_work", "jobs.cancel_job", password="correct horse")
    job = JobFactory(running=True, name="jobapp.ping.v1")
    page = log_in(browser, live_server, "viewer", "/admin/jobs/job/overview/")
    assert page.locator("a.jobs-pause").count() == 0
    page.goto(f"{live_server.url}/admin/jobs/job/{job.pk}/change/")
    assert page.locator("#cancel-job").count() == 0

    def post(page, path: str, with_token: bool) -> int:
        return page.evaluate(
            """async ([path, withToken]) => {
                const body = new URLSearchParams({post: "yes", kind: "job_type",
                                                  value: "jobapp.ping.v1"});
                if (withToken) {
                    const cookies = document.cookie.split("; ");
                    const cookie = cookies.find(c => c.startsWith("csrftoken="));
                    body.set("csrfmiddlewaretoken", cookie.split("=")[1]);
                }
                const response = await fetch(path, {method: "POST", body});
                return response.status;
            }""",
            [path, with_token],
        )

    cancel = f"/admin/jobs/job/{job.pk}/cancel/"
    add_pause = "/admin/jobs/pause/add/"
    assert post(page, cancel, with_token=True) == 403  # no jobs.cancel_job
    assert post(page, add_pause, with_token=True) == 403  # no jobs.pause_work

    ops = log_in(browser, live_server, "ops", f"/admin/jobs/job/{job.pk}/change/")
    assert post(ops, cancel, with_token=False) == 403  # the permission, but no CSRF token
    assert post(ops, add_pause, with_token=False) == 403
    assert Job.objects.get(pk=job.pk).cancel_requested_at is None
    assert not Pause.objects.exists() and not LogEntry.objects.exists()

    # The same POST with the page's token and the permission acts (and is recorded).
    assert post(ops, add_pause, with_token=True) == 200  # after the redirect
    assert list(Pause.objects.values_list("value", "paused_by")) == [("jobapp.ping.v1", "ops")]
    assert LogEntry.objects.get().user.username == "ops"
