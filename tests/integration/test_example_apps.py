"""The example consumers on the real worker: each keeps its run row and its own replay."""

from __future__ import annotations

import pytest
from django.core.management import call_command

import jobs
from jobs.control.tables import RunTable
from jobs.models import Job
from jobs.runs import ErrorCode, RunState
from jobs.testing import JobFailed, run_worker
from project.curation import passes
from project.curation.models import CurationRun, Document
from project.harvester.jobs import HarvestItemV1
from project.harvester.models import DeadLetter, Item
from project.mail import deliveries
from project.mail.jobs import DeliverMailV1
from project.mail.models import Delivery
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db(transaction=True)


def fails_with(code: str) -> None:
    with pytest.raises(JobFailed) as failed:
        run_worker()
    assert failed.value.code == code


class TestMail:
    def test_a_message_is_delivered_and_its_row_says_so(self, mailoutbox):
        delivery = deliveries.send("ann@example.com", "Hi", "Body", key="welcome-1")

        run_worker()

        row = Delivery.objects.get(pk=delivery.pk)
        assert (row.state, row.status, row.attempts) == (RunState.SUCCEEDED, "delivered", 1)
        assert row.sent_at is not None and row.heartbeat_at is not None
        assert [m.to for m in mailoutbox] == [["ann@example.com"]]

    def test_a_refused_message_is_not_delivered_and_replay_resends_it(self, mailoutbox):
        delivery = deliveries.send("bo@blocked.example", "Hi", key="welcome-2")

        fails_with(ErrorCode.REJECTED)

        row = Delivery.objects.get(pk=delivery.pk)
        assert (row.state, row.status, row.last_error) == ("failed", "not delivered", "rejected")
        assert "blocked.example" in row.error_detail
        Delivery.objects.filter(pk=delivery.pk).update(to="bo@example.com")  # the address fixed

        assert Delivery.replay([delivery.pk], by="alice") == 1

        row = Delivery.objects.get(pk=delivery.pk)
        assert (row.state, row.resends, row.attempts) == (RunState.QUEUED, 1, 0)
        resend = Job.objects.get(pk=row.job_pk)  # its own job again, not a second one
        assert (resend.job_id, resend.state) == (f"mail-delivery-{delivery.pk}", RunState.QUEUED)
        run_worker()
        assert Delivery.objects.get(pk=delivery.pk).status == "delivered"
        assert len(mailoutbox) == 1

    def test_a_flaky_relay_is_retried_then_not_delivered(self):
        delivery = Delivery.objects.create(to="cy@flaky.example", subject="Hi", job_id="w-3")
        jobs.enqueue(DeliverMailV1(delivery_id=delivery.pk), max_attempts=2)

        fails_with(ErrorCode.HANDLER_ERROR)

        row = Delivery.objects.get(pk=delivery.pk)
        assert (row.state, row.attempts, row.last_error) == ("failed", 2, "handler_error")
        assert "RelayTimeout" in row.error_detail

    def test_two_resends_at_once_send_once(self, threads):
        delivery = Delivery.objects.create(
            to="d@example.com", subject="Hi", job_id="w-4", state=RunState.FAILED
        )

        counts = threads(2, lambda i: Delivery.replay([delivery.pk], by=f"op{i}"))

        assert sorted(counts) == [0, 1]
        assert Job.objects.filter(name="mail.deliver.v1").count() == 1


class TestHarvester:
    def test_an_item_that_404s_is_dead_lettered_and_replay_repicks_it(self):
        item = Item.objects.create(url="https://archive.example/missing/report")
        jobs.enqueue(HarvestItemV1(item_id=item.pk))

        fails_with(ErrorCode.REJECTED)

        dead = DeadLetter.objects.get(item=item)
        assert (dead.state, dead.attempts, dead.job_id) == ("failed", 1, f"harvest-item-{item.pk}")
        assert "answered 404" in dead.error_detail
        Item.objects.filter(pk=item.pk).update(url="https://archive.example/reports/annual")

        assert DeadLetter.replay([dead.pk], by="alice") == 1

        assert DeadLetter.objects.get(pk=dead.pk).state == RunState.QUEUED
        run_worker()
        dead = DeadLetter.objects.get(pk=dead.pk)
        assert dead.state == RunState.SUCCEEDED and dead.heartbeat_at is not None
        item = Item.objects.get(pk=item.pk)
        assert item.harvested_at is not None and item.title == "Annual"
        assert DeadLetter.objects.count() == 1

    def test_a_repick_that_fails_again_lands_back_in_the_same_dead_letter(self):
        item = Item.objects.create(url="https://archive.example/missing/report")
        jobs.enqueue(HarvestItemV1(item_id=item.pk))
        fails_with(ErrorCode.REJECTED)
        dead = DeadLetter.objects.get(item=item)

        DeadLetter.replay([dead.pk], by="alice")
        fails_with(ErrorCode.REJECTED)

        dead = DeadLetter.objects.get(pk=dead.pk)
        assert (dead.state, dead.attempts) == (RunState.FAILED, 2)
        assert DeadLetter.objects.count() == 1

    def test_a_source_that_times_out_is_dead_lettered_on_the_last_attempt(self):
        item = Item.objects.create(url="https://feeds.example/slow/ticker")
        jobs.enqueue(HarvestItemV1(item_id=item.pk), max_attempts=1)

        fails_with(ErrorCode.HANDLER_ERROR)

        dead = DeadLetter.objects.get(item=item)
        assert dead.last_error == ErrorCode.HANDLER_ERROR and "timed out" in dead.error_detail

    def test_two_repicks_at_once_repick_once(self, threads):
        item = Item.objects.create(url="https://news.example/a")
        dead = DeadLetter.objects.create(
            item=item, job_id=f"harvest-item-{item.pk}", state=RunState.FAILED, attempts=1
        )

        counts = threads(2, lambda i: DeadLetter.replay([dead.pk], by=f"op{i}"))

        assert sorted(counts) == [0, 1]
        assert Job.objects.filter(name="harvester.harvest.v1").count() == 1


class TestCuration:
    def make_collection(self, *bodies: str) -> list[Document]:
        return [
            Document.objects.create(collection="news", title=f"Doc {i}", body=body)
            for i, body in enumerate(bodies)
        ]

    def test_a_failed_pass_keeps_its_cause_and_stats_and_replay_starts_a_new_run(self):
        _first, empty = self.make_collection("Text.", "")
        run = passes.start_pass("news", by="cron")

        fails_with(ErrorCode.REJECTED)

        run.refresh_from_db()
        assert (run.state, run.last_error) == (RunState.FAILED, ErrorCode.REJECTED)
        assert run.stats == {"checked": 2, "curated": 1, "failed_at": empty.pk}
        assert "has no body" in run.error_detail and run.heartbeat_at is not None
        Document.objects.filter(pk=empty.pk).update(body="Now with text.")

        assert CurationRun.replay([run.pk], by="alice") == 1

        new = CurationRun.objects.get(replay_of=run)
        assert (new.state, new.requested_by, new.job_id) == ("queued", "alice", run.job_id)
        run_worker()
        new.refresh_from_db()
        assert new.state == RunState.SUCCEEDED and new.stats == {"checked": 2, "curated": 2}
        assert CurationRun.objects.get(pk=run.pk).state == RunState.FAILED  # history stays
        assert not Document.objects.filter(curated_at__isnull=True).exists()

    def test_a_run_is_replayed_once_however_often_it_is_asked(self, threads):
        run = CurationRun.objects.create(
            collection="news", job_id="curation-news", state=RunState.FAILED
        )

        counts = threads(2, lambda i: CurationRun.replay([run.pk], by=f"op{i}"))

        assert sorted(counts) == [0, 1]
        assert CurationRun.replay([run.pk], by="carol") == 0
        assert CurationRun.objects.filter(replay_of=run).count() == 1
        assert Job.objects.filter(name="curation.pass.v1").count() == 1

    def test_no_new_run_while_a_pass_over_the_collection_is_active(self):
        failed = CurationRun.objects.create(
            collection="news", job_id="curation-news", state=RunState.FAILED
        )
        assert passes.start_pass("news") is not None

        assert CurationRun.replay([failed.pk], by="alice") == 0
        assert passes.start_pass("news") is None  # one active pass per collection


def test_the_jobs_table_replays_the_same_row():
    job = JobFactory(failed=True, attempts=5)
    assert RunTable(Job).replay([job.pk], by="alice") == 1
    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.attempts, row.replayed_by) == (RunState.QUEUED, 0, "alice")
    assert Job.objects.count() == 1


def test_demo_seed_enqueues_work_for_every_example_once():
    call_command("demo_seed")
    call_command("demo_seed")  # a second run adds nothing

    assert Delivery.objects.count() == 8  # five to send, three undelivered from before
    assert Item.objects.count() == 4 and CurationRun.objects.count() == 2
    assert Job.objects.filter(state=RunState.QUEUED).count() == 13  # the import, the charge
