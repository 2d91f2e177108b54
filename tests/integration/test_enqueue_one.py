"""A job enqueued on its own goes in through ``jobs_enqueue_job``, a function of its own; a
batch goes in through one multi-row statement. Whichever way it goes, the row is the same."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.models import FlowGate, Job
from jobs.queue import NewJob
from tests.support.enqueue import COLUMNS

NAMES = ("one.a.v1", "one.b.v1")

pytestmark = pytest.mark.django_db(transaction=True)

keys = itertools.count()
# Text the database stores (no NUL, no lone surrogate): payloads' checks are tested elsewhere.
WORDS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")


def stored(enqueued: queue.Enqueued, job: NewJob) -> tuple:
    """The row's columns; its due time as given, or as an offset from its creation."""
    row = Job.objects.get(pk=enqueued.id)
    due = (
        row.run_after
        if job.run_after
        else round((row.run_after - row.created_at).total_seconds(), 3)
    )
    return (*(getattr(row, c) for c in COLUMNS), due)


def alone(job: NewJob) -> queue.Enqueued:
    return queue.enqueue(job)


def alone_in_a_transaction(job: NewJob) -> queue.Enqueued:
    with transaction.atomic():
        return queue.enqueue(job)


def first_of_a_batch(job: NewJob) -> queue.Enqueued:
    return queue.enqueue_many([job, NewJob(NAMES[0], {})])[0]


WAYS = (alone, alone_in_a_transaction, first_of_a_batch)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(NAMES),
    fair=st.sets(st.sampled_from(NAMES)),
    when=st.one_of(
        st.none(),
        st.integers(-3600, 3600).map(lambda s: {"delay": timedelta(seconds=s)}),
        st.integers(-3600, 3600).map(
            lambda s: {"run_after": timezone.now().replace(microsecond=0) + timedelta(seconds=s)}
        ),
    ),
    priority=st.integers(-100, 100),
    tenant=st.sampled_from([None, "acme"]),
    keyed=st.booleans(),
    max_attempts=st.one_of(st.none(), st.integers(1, 50)),
    payload=st.dictionaries(
        st.text(WORDS, max_size=5), st.integers() | st.text(WORDS, max_size=5), max_size=3
    ),
)
def test_a_job_on_its_own_is_stored_as_in_a_batch(
    name, fair, when, priority, tenant, keyed, max_attempts, payload
):
    """Any job (tenant-ordered type or not, due now, later, earlier or at a given time, with
    or without a key): enqueued alone, alone in the caller's transaction, or in a batch, it
    is stored alike."""
    FlowGate.objects.all().delete()
    for tenant_ordered in fair:
        FlowGate.objects.create(name=tenant_ordered, tenant_ordered=True)

    def job() -> NewJob:
        return NewJob(
            name,
            payload,
            priority=priority,
            tenant=tenant,
            max_attempts=max_attempts,
            job_id=f"key-{next(keys)}" if keyed else None,
            **(when or {}),
        )

    rows = []
    for way in WAYS:
        made = job()
        enqueued = way(made)
        assert enqueued.created and enqueued.state == "queued"
        rows.append(stored(enqueued, made))
    assert rows[0] == rows[1] == rows[2]
    assert rows[0][COLUMNS.index("fair")] == (name in fair)
