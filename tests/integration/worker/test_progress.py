"""Progress reports on real PostgreSQL: carried by the lease renewal (no statement of their
own), written with the outcome, shown by the admin and by ``get_result()``."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.backends.utils import CursorWrapper
from django.tasks import task
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import JobContext, Payload, enqueue, queue
from jobs.catalogue.registry import JobType, Policy, Registry
from jobs.core.progress import Progress
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory
from jobs.queue import ClaimRequest, NewJob, Outcome
from jobs.queue.outcomes import with_progress
from jobs.queue.types import AllTenants
from jobs.testing import run_worker
from jobs.worker.config import WorkerConfig
from jobs.worker.execution import Running, make_context
from jobs.worker.leases import LeaseKeeper
from jobs.worker.runner import Worker
from tests.support.admin import client_for, operator
from tests.support.factories import JobFactory
from tests.support.polling import wait_for

NAME = "test.progress.v1"


class Count(Payload, name=NAME):
    items: int = 0


class Script:
    """A handler that reports every item, then waits for the test before its last report."""

    def __init__(self, hold: bool = True) -> None:
        self.reported = threading.Event()
        self.release = threading.Event()
        self.hold = hold
        self.thread: int | None = None

    def __call__(self, payload: Count, ctx: JobContext) -> None:
        self.thread = threading.get_ident()
        for done in range(payload.items + 1):
            ctx.progress(done, payload.items, f"item {done}")
        self.reported.set()
        if self.hold:
            self.release.wait(10)
        ctx.progress(payload.items, payload.items, "finished")


def registry(script: Script) -> Registry:
    return Registry([JobType(Count, script, Policy(timeout=timedelta(seconds=20)))])


def claim_one() -> Running:
    [job] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants(), worker="w1")
    job_type = JobType(Count, Script(), Policy())
    return Running(job, job_type, make_context(job, job_type))


def progress_of(job_id: int) -> dict | None:
    return Job.objects.values_list("progress", flat=True).get(pk=job_id)


def updates() -> tuple[int, int]:
    """This transaction's row updates of the jobs table, and how many of them were HOT."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
            "WHERE relname = 'jobs_job'"
        )
        return cur.fetchone()


@pytest.mark.django_db
class TestRenewal:
    def test_a_report_reaches_the_row_with_the_next_renewal_and_not_before(self):
        queue.enqueue(NewJob(NAME))
        running = claim_one()
        keeper = LeaseKeeper(lambda: [running], lease_seconds=10)

        with CaptureQueriesContext(connection) as reporting:
            for done in range(5000):
                running.ctx.progress(done, 5000, "copying")
        assert len(reporting) == 0  # reporting is memory only
        assert progress_of(running.job.id) is None

        before = updates()
        keeper.renew_once()
        after = updates()

        assert progress_of(running.job.id) == {
            "done": 4999,
            "total": 5000,
            "note": "copying",
            "attempt": 1,
        }
        # One row updated by the renewal, and HOT: progress is in no index.
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
        assert running.ctx.unsent_progress() is None  # sent once

    def test_a_renewal_without_reports_keeps_the_last_one(self):
        queue.enqueue(NewJob(NAME))
        running = claim_one()
        keeper = LeaseKeeper(lambda: [running], lease_seconds=10)
        running.ctx.progress(2, 4, "half")
        keeper.renew_once()
        with CaptureQueriesContext(connection) as renewal:
            keeper.renew_once()
        [statement] = [q["sql"] for q in renewal.captured_queries]
        assert "renewed AS" in statement
        assert progress_of(running.job.id)["note"] == "half"

    def test_a_report_without_a_total_and_a_storable_note(self):
        queue.enqueue(NewJob(NAME))
        running = claim_one()
        running.ctx.progress(7, note="bad\x00byte")
        LeaseKeeper(lambda: [running], lease_seconds=10).renew_once()
        assert progress_of(running.job.id) == {
            "done": 7,
            "total": None,
            "note": "bad\\x00byte",
            "attempt": 1,
        }

    def test_the_outcome_carries_the_last_report_and_keeps_an_earlier_one(self):
        queue.enqueue(NewJob(NAME))
        queue.enqueue(NewJob(NAME))
        [first, second] = queue.claim([ClaimRequest(NAME, 2)], scope=AllTenants())
        queue.renew_leases([second], progress={second.claim_token: Progress(1, 2, "renewed")})

        queue.record(
            [
                with_progress(Outcome.succeeded(first), Progress(5, 5, "all", attempt=1)),
                Outcome.succeeded(second),
            ]
        )

        assert progress_of(first.id) == {"done": 5, "total": 5, "note": "all", "attempt": 1}
        assert progress_of(second.id)["note"] == "renewed"


@pytest.mark.django_db(transaction=True)
class TestWorker:
    def test_a_locked_row_keeps_its_report_for_the_next_renewal(self):
        queue.enqueue(NewJob(NAME))
        running = claim_one()
        keeper = LeaseKeeper(lambda: [running], lease_seconds=10)
        running.ctx.progress(1, 3)
        locked, release = threading.Event(), threading.Event()

        def hold_the_row() -> None:
            try:
                with transaction.atomic():
                    Job.objects.select_for_update().get(pk=running.job.id)
                    locked.set()
                    release.wait(10)
            finally:
                connection.close()

        holder = threading.Thread(target=hold_the_row)
        holder.start()
        try:
            assert locked.wait(10)
            keeper.renew_once()
            assert running.ctx.unsent_progress() is not None  # not written: still to send
            assert progress_of(running.job.id) is None
        finally:
            release.set()
            holder.join(10)
        keeper.renew_once()
        assert progress_of(running.job.id)["done"] == 1
        assert running.ctx.unsent_progress() is None

    def test_thousands_of_reports_make_only_renewal_statements(self, monkeypatch):
        statements: list[tuple[int, str]] = []
        real = CursorWrapper._execute

        def recording(self, sql, params, *ignored_wrappers):
            statements.append((threading.get_ident(), sql))
            return real(self, sql, params, *ignored_wrappers)

        monkeypatch.setattr(CursorWrapper, "_execute", recording)
        script = Script()
        job = enqueue(Count(items=3000))
        config = WorkerConfig(
            lease=timedelta(seconds=0.3), poll_interval=0.05, install_signal_handlers=False
        )
        worker = Worker(registry(script), config)
        runner = threading.Thread(target=worker.run)
        runner.start()
        try:
            assert script.reported.wait(10)
            wait_for(
                lambda: (progress_of(job.id) or {}).get("done") == 3000,
                timeout=5,
                what="the report in the row",
            )
            assert progress_of(job.id)["note"] == "item 3000"
            script.release.set()
            wait_for(
                lambda: Job.objects.get(pk=job.id).state == "succeeded",
                timeout=5,
                what="the outcome",
            )
        finally:
            script.release.set()
            worker.request_stop()
            runner.join(10)

        assert progress_of(job.id)["note"] == "finished"
        assert not [sql for thread, sql in statements if thread == script.thread]
        writes = [sql for _, sql in statements if "progress = COALESCE" in sql]
        renewals = [sql for sql in writes if "renewed AS" in sql]
        assert renewals, "no renewal ran"
        # The only statements that write progress: the renewals and one outcome pass.
        assert len(writes) - len(renewals) <= 1
        assert len(renewals) < 200  # a few a second, whatever the 3000 reports

    def test_a_report_made_just_before_returning_is_written_with_the_outcome(self):
        script = Script(hold=False)
        job = enqueue(Count(items=4))
        run_worker(registry=registry(script))  # the default lease: no renewal in between
        row = Job.objects.get(pk=job.id)
        assert row.state == "succeeded"
        assert row.progress == {"done": 4, "total": 4, "note": "finished", "attempt": 1}


class AsyncScript(Script):
    """The same, as an ``async def`` handler on the worker's event loop."""

    async def __call__(self, payload: Count, ctx: JobContext) -> None:  # type: ignore[override]
        for done in range(payload.items + 1):
            ctx.progress(done, payload.items, f"item {done}")
            if done % 100 == 0:
                await asyncio.sleep(0)
        self.reported.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        ctx.progress(payload.items, payload.items, "finished")


@pytest.mark.django_db(transaction=True)
def test_an_async_handler_reports_the_same_way():
    script = AsyncScript()
    assert JobType(Count, script).is_async  # run on the worker's event loop
    job = enqueue(Count(items=500))
    config = WorkerConfig(
        lease=timedelta(seconds=0.3), poll_interval=0.05, install_signal_handlers=False
    )
    worker = Worker(registry(script), config)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert script.reported.wait(10)
        wait_for(
            lambda: (progress_of(job.id) or {}).get("note") == "item 500",
            timeout=5,
            what="the report in the row",
        )
        script.release.set()
        wait_for(
            lambda: Job.objects.get(pk=job.id).state == "succeeded", timeout=5, what="the outcome"
        )
    finally:
        script.release.set()
        worker.request_stop()
        runner.join(10)
    assert progress_of(job.id) == {"done": 500, "total": 500, "note": "finished", "attempt": 1}


@task(takes_context=True)
def crunch(context, items: int) -> int:
    for done in range(items + 1):
        context.progress(done, items, f"step {done}")
    return items


@pytest.mark.django_db(transaction=True)
def test_get_result_exposes_the_progress_of_a_django_task():
    result = crunch.enqueue(6)
    assert result.progress is None

    run_worker()

    again = crunch.get_result(result.id)
    assert again.progress == Progress(6, 6, "step 6", attempt=1)
    assert again.progress.percent == 100
    result.refresh()
    assert result.progress == again.progress and result.return_value == 6


@pytest.fixture
def viewer():
    return client_for(operator("viewer", "jobs.view_job"))


def page(client, job, **headers) -> str:
    response = client.get(reverse("admin:jobs_job_change", args=[job.pk]), headers=headers)
    assert response.status_code == 200
    return response.content.decode()


@pytest.mark.django_db
class TestAdmin:
    def test_a_running_jobs_page_shows_its_progress_and_refreshes_it_live(self, viewer):
        job = JobFactory(running=True, progress={"done": 3, "total": 10, "note": "copying"})

        shown = page(viewer, job)

        assert '<progress value="3" max="10">30%</progress>' in shown
        assert "3 / 10 (30%) — copying" in shown
        assert 'data-jobs-live="progress"' in shown and "data-jobs-live-root" in shown
        assert "updated <time" in shown  # the heartbeat that wrote it
        Job.objects.filter(pk=job.pk).update(progress={"done": 7, "total": 10, "note": ""})
        response = viewer.get(
            reverse("admin:jobs_job_change", args=[job.pk]), headers={"X-Jobs-Live": "1"}
        )
        assert "7 / 10 (70%)" in response.content.decode()
        assert "X-Jobs-Live" in response["Vary"]

    def test_the_running_jobs_view_has_a_progress_column(self, viewer):
        JobFactory(running=True, progress={"done": 1, "total": 4, "note": "one down"})
        JobFactory(running=True)
        url = reverse("admin:jobs_job_changelist")

        running = viewer.get(url, {"state__exact": "running"}).content.decode()
        everything = viewer.get(url).content.decode()

        assert 'class="field-progress_column"' in running
        assert 'title="1 / 4 (25%) — one down"' in running and "25%" in running
        assert 'class="field-progress_column"' not in everything

    def test_a_finished_job_shows_its_last_report_and_does_not_refresh(self, viewer):
        job = JobFactory(succeeded=True, progress={"done": 9, "total": None, "note": "rows"})
        shown = page(viewer, job)
        assert "9 done — rows" in shown and "the last report" in shown
        assert "data-jobs-live-root" not in shown

    def test_a_report_from_an_earlier_attempt_says_so_and_nonsense_shows_as_none(self, viewer):
        earlier = JobFactory(
            running=True, attempts=2, progress={"done": 1, "total": 2, "note": "", "attempt": 1}
        )
        assert "reported by attempt 1" in page(viewer, earlier)
        odd = JobFactory(running=True, progress={"done": "lots"})
        assert "no report yet" in page(viewer, odd)

    def test_the_history_page_shows_the_final_report(self, viewer):
        from jobs.queue import history

        job = JobFactory(succeeded=True, progress={"done": 2, "total": 2, "note": "end"})
        Job.objects.filter(pk=job.pk).update(key_held=False)
        history.archive(now=database_now() + timedelta(minutes=2))
        assert JobHistory.objects.filter(pk=job.pk).exists()

        response = viewer.get(reverse("admin:jobs_jobhistory_change", args=[job.pk]))

        assert "2 / 2 (100%) — end" in response.content.decode()


@pytest.mark.django_db
def test_a_process_page_shows_the_progress_of_the_jobs_it_holds(client):
    from django.contrib.auth.models import Permission, User

    from tests.support.process_rows import claim_for, register

    user = User.objects.create_user("ops", is_staff=True)
    for codename in ("view_process", "view_job"):  # held jobs are shown to job viewers
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    register("w1:1:aa")
    [job] = claim_for("w1:1:aa")
    queue.renew_leases([job], progress={job.claim_token: Progress(2, 8, "two of eight")})

    page = client.get(reverse("admin:jobs_process_change", args=["w1:1:aa"])).content.decode()

    assert 'title="2 / 8 (25%) — two of eight"' in page
    assert '<progress value="2" max="8">25%</progress>' in page
