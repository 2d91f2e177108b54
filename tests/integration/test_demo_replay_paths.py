"""Every replay path of the demo's apps resolves both homes of the failure it redoes.

A failure of an example app shows twice in the monitor: the failed job (``jobs.job``) and the
domain's row (a delivery, a dead letter, a curation run). Whichever of the two an operator
replays, once the worker has redone the work neither is offered as an open failure any more.
Each test replays through the monitor's own dispatch (``jobs.control.replays``, as the admin
and ``manage.py replay`` do), then runs the real worker.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

import jobs
from jobs.control import replays as replay
from jobs.control.failures import fetch_page
from jobs.control.tables import Filters, run_tables
from jobs.models import Job
from jobs.runs import ErrorCode, RunState
from jobs.testing import JobFailed, run_worker
from project.curation import passes
from project.curation.models import CurationRun, Document
from project.harvester.jobs import HarvestItemV1
from project.harvester.models import DeadLetter, Item
from project.mail import deliveries
from project.mail.models import Delivery

pytestmark = pytest.mark.django_db(transaction=True)


def fails_with(code: str) -> None:
    with pytest.raises(JobFailed) as failed:
        run_worker()
    assert failed.value.code == code


def open_failures() -> set[str]:
    """What the monitor's default view (failed rows) offers to replay, as row tokens."""
    return {row.token for row in fetch_page(run_tables(), Filters()).rows if row.replayable}


def replay_in_monitor(*tokens: str) -> None:
    """Replay as an operator does from the monitor (the admin and the command dispatch here)."""
    operator = get_user_model().objects.create_superuser("alice")
    targets = replay.parse_tokens(tokens, run_tables())
    done = replay.replay(operator, targets, via="the test")
    assert sum(len(r.replayed) for r in done) == len(tokens)


def failed_job(name: str) -> Job:
    return Job.objects.get(name=name, state=RunState.FAILED)


class TestHarvester:
    def dead_lettered_item(self) -> tuple[Item, DeadLetter, Job]:
        item = Item.objects.create(url="https://archive.example/missing/report")
        jobs.enqueue(HarvestItemV1(item_id=item.pk), job_id=f"harvest-{item.pk}")
        fails_with(ErrorCode.REJECTED)
        dead = DeadLetter.objects.get(item=item)
        job = failed_job("harvester.harvest.v1")
        assert open_failures() == {f"jobs.job:{job.pk}", f"harvester.deadletter:{dead.pk}"}
        return item, dead, job

    def fix(self, item: Item) -> None:
        Item.objects.filter(pk=item.pk).update(url="https://archive.example/reports/annual")

    def test_replaying_the_failed_job_resolves_its_dead_letter(self):
        item, dead, job = self.dead_lettered_item()
        self.fix(item)

        replay_in_monitor(f"jobs.job:{job.pk}")
        run_worker()

        assert Item.objects.get(pk=item.pk).harvested_at is not None
        dead.refresh_from_db()
        assert (dead.state, dead.finished_at is not None) == (RunState.SUCCEEDED, True)
        assert Job.objects.get(pk=job.pk).state == RunState.SUCCEEDED
        assert open_failures() == set()

    def test_a_replayed_job_that_fails_again_keeps_one_open_dead_letter(self):
        _item, dead, job = self.dead_lettered_item()

        replay_in_monitor(f"jobs.job:{job.pk}")
        fails_with(ErrorCode.REJECTED)

        dead.refresh_from_db()
        assert (dead.state, dead.attempts) == (RunState.FAILED, 2)
        assert DeadLetter.objects.count() == 1
        assert open_failures() == {f"jobs.job:{job.pk}", f"harvester.deadletter:{dead.pk}"}

    def test_repicking_the_dead_letter_replays_its_failed_job(self):
        item, dead, job = self.dead_lettered_item()
        self.fix(item)

        replay_in_monitor(f"harvester.deadletter:{dead.pk}")
        run_worker()

        assert DeadLetter.objects.get(pk=dead.pk).state == RunState.SUCCEEDED
        job.refresh_from_db()
        assert (job.state, job.replayed_by) == (RunState.SUCCEEDED, "alice")
        assert Job.objects.filter(name="harvester.harvest.v1").count() == 1
        assert open_failures() == set()

    def test_a_dead_letter_whose_job_is_gone_is_repicked_with_a_new_job(self):
        item, dead, job = self.dead_lettered_item()
        self.fix(item)
        Job.objects.filter(pk=job.pk).delete()  # pruned by retention, say

        replay_in_monitor(f"harvester.deadletter:{dead.pk}")
        run_worker()

        assert DeadLetter.objects.get(pk=dead.pk).state == RunState.SUCCEEDED
        assert Job.objects.get().state == RunState.SUCCEEDED
        assert open_failures() == set()


class TestMail:
    def undelivered(self) -> tuple[Delivery, Job]:
        delivery = deliveries.send("bo@blocked.example", "Hi", key="welcome-1")
        fails_with(ErrorCode.REJECTED)
        job = failed_job("mail.deliver.v1")
        assert open_failures() == {f"jobs.job:{job.pk}", f"mail.delivery:{delivery.pk}"}
        Delivery.objects.filter(pk=delivery.pk).update(to="bo@example.com")  # the address fixed
        return delivery, job

    def test_replaying_the_failed_job_delivers_the_message(self, mailoutbox):
        delivery, job = self.undelivered()

        replay_in_monitor(f"jobs.job:{job.pk}")
        run_worker()

        assert Delivery.objects.get(pk=delivery.pk).status == "delivered"
        assert Job.objects.get(pk=job.pk).state == RunState.SUCCEEDED
        assert len(mailoutbox) == 1 and open_failures() == set()

    def test_resending_the_delivery_replays_its_failed_job(self, mailoutbox):
        delivery, job = self.undelivered()

        replay_in_monitor(f"mail.delivery:{delivery.pk}")
        run_worker()

        row = Delivery.objects.get(pk=delivery.pk)
        assert (row.status, row.resends) == ("delivered", 1)
        job.refresh_from_db()
        assert (job.state, job.replayed_by) == (RunState.SUCCEEDED, "alice")
        assert Job.objects.filter(name="mail.deliver.v1").count() == 1
        assert len(mailoutbox) == 1 and open_failures() == set()


class TestCuration:
    def failed_pass(self) -> tuple[CurationRun, Job, Document]:
        Document.objects.create(collection="news", title="Filled", body="Text.")
        empty = Document.objects.create(collection="news", title="Empty", body="")
        run = passes.start_pass("news", by="cron")
        fails_with(ErrorCode.REJECTED)
        job = failed_job("curation.pass.v1")
        assert open_failures() == {f"jobs.job:{job.pk}", f"curation.curationrun:{run.pk}"}
        Document.objects.filter(pk=empty.pk).update(body="Now with text.")  # the cause fixed
        return run, job, empty

    def assert_replaced_by_a_successful_run(self, run: CurationRun, by: str) -> None:
        new = CurationRun.objects.get(replay_of=run)
        assert (new.state, new.requested_by) == (RunState.SUCCEEDED, by)
        assert new.stats == {"checked": 2, "curated": 2}
        assert CurationRun.objects.get(pk=run.pk).state == RunState.FAILED  # kept as history
        assert not Document.objects.filter(curated_at__isnull=True).exists()

    def test_replaying_the_failed_job_starts_a_new_run(self):
        run, job, _empty = self.failed_pass()

        replay_in_monitor(f"jobs.job:{job.pk}")
        run_worker()

        self.assert_replaced_by_a_successful_run(run, by="alice")
        assert Job.objects.get(pk=job.pk).state == RunState.SUCCEEDED
        assert open_failures() == set()

    def test_replaying_the_run_reuses_its_failed_job(self):
        run, job, _empty = self.failed_pass()

        replay_in_monitor(f"curation.curationrun:{run.pk}")
        run_worker()

        self.assert_replaced_by_a_successful_run(run, by="alice")
        job.refresh_from_db()
        assert (job.state, job.replayed_by) == (RunState.SUCCEEDED, "alice")
        assert Job.objects.filter(name="curation.pass.v1").count() == 1
        assert open_failures() == set()
