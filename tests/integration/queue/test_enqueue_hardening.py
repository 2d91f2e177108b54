"""Enqueue refuses text PostgreSQL cannot store, and agrees on the live row under races."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import Payload, queue
from jobs.models import Job
from jobs.queue import (
    InvalidJob,
    NewJob,
)
from tests.support.factories import JobFactory
from tests.support.noop_jobs import enqueue


@pytest.mark.django_db
@pytest.mark.parametrize(
    "job, message",
    [
        (NewJob("a.v1", {"text": "a\x00b"}), "payload is not JSON-serializable: .*NUL.*\\$\\.text"),
        (NewJob("a.v1", {"k\x00": 1}), "payload is not JSON-serializable: .*NUL"),
        (NewJob("a.v1", {"t": ["\ud83d"]}), "payload .*lone surrogate.*\\$\\.t\\[0\\]"),
        (NewJob("a.v1", job_id="id\x00"), "job_id contains a NUL character"),
        (NewJob("a.v1", job_id="id\udfff"), "job_id contains a lone surrogate"),
        (NewJob("a\x00.v1"), "name contains a NUL character"),
        (NewJob("a.v1", tenant="acme\n"), "tenant must be 1-64 characters"),
        (NewJob("a.v1", tenant="acme\x00"), "tenant must be 1-64 characters"),
        (NewJob("a.v1", queue="q\n"), "queue must be 1-64 characters"),
        (NewJob("a.v1", delay=timedelta.max), "delay must be a timedelta of at most"),
    ],
)
def test_bad_text_is_refused_before_any_statement_and_the_transaction_survives(job, message):
    with transaction.atomic():
        with pytest.raises(InvalidJob, match=message):
            queue.enqueue(job)
        # The caller's transaction is still usable: nothing reached the database.
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM jobs_job")
            assert cur.fetchone() == (0,)


def test_job_type_names_match_their_pattern_exactly():
    with pytest.raises(TypeError, match="invalid job name"):
        type("Trailing", (Payload,), {}, name="shop.receipt.v1\n")
    # The refused class lingers in Payload.__subclasses__() until collected, where the
    # registry's system checks would meet it.
    gc.collect()
    assert not [c for c in Payload.__subclasses__() if c.__name__ == "Trailing"]


@pytest.mark.django_db(transaction=True)
def test_callers_racing_a_window_expiry_are_all_told_about_the_live_row(threads):
    for round_ in range(15):
        key = f"race-{round_}"
        old = JobFactory(job_id=key, succeeded=True, finished_at=timezone.now() - timedelta(days=2))

        results = threads(4, lambda _i, key=key: queue.enqueue(NewJob("a.v1", job_id=key)))

        live = Job.objects.get(job_id=key, key_held=True)
        assert live.pk != old.pk and live.state == "queued"
        assert {r.id for r in results} == {live.pk}, f"round {round_}: {results}"
        assert sum(r.created for r in results) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("count", [1, 2], ids=["alone", "batch"])
@pytest.mark.parametrize("value", [2**31, 2**63], ids=["int8", "numeric"])
def test_max_attempts_past_the_integer_column_is_an_invalid_job(count, value):
    with transaction.atomic():
        with pytest.raises(InvalidJob, match="max_attempts"):
            enqueue(count, max_attempts=value)
        # The caller's transaction is still usable: nothing ran.
        assert Job.objects.count() == 0
    with pytest.raises(InvalidJob, match="max_attempts"):
        enqueue(count, max_attempts=value)  # outside a transaction (the one-statement path)


NOOP = "test.noop.v1"


class Drained(dict):
    """A mapping read by draining it (a work list, a one-shot view): its items() empties it."""

    def items(self):
        while self:
            yield self.popitem()


@pytest.mark.django_db(transaction=True)
def test_a_payload_emptied_by_its_own_read_is_refused_not_stored_empty():
    """A payload whose reading changes it is judged on its first reading: this one holds a
    NaN, so enqueue refuses it, rather than encode the mapping its first reading emptied and
    store the job with the payload ``{}``."""
    with pytest.raises(InvalidJob, match="not JSON-serializable"):
        queue.enqueue(NewJob(NOOP, Drained(order=7, score=float("nan"))))
    assert list(Job.objects.values_list("payload", flat=True)) == []
