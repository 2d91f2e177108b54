"""Enqueueing typed payloads: names, encoding, policy defaults and whole-batch validation."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jobs
from jobs import JobSpec, Payload
from jobs.api.producer import new_jobs
from jobs.models import Job
from jobs.queue import InvalidJob
from tests.jobapp.jobs import AuditV1, PingV1

pytestmark = pytest.mark.django_db

EMAIL_ID = UUID("6f1c1f0e-8a6e-4c55-9a39-0d2d7f0b5c11")


class SendEmailV1(Payload, name="producer.email.send.v1"):
    """Not registered in this process: producers may enqueue types only workers elsewhere run."""

    email_id: UUID

    def validate(self) -> None:
        if self.email_id.int == 0:
            raise ValueError("email_id must not be the zero UUID")


class ImpostorPingV1(Payload, name="jobapp.ping.v1"):
    message: str


def test_enqueue_stores_name_encoded_payload_and_the_policy_defaults():
    result = jobs.enqueue(PingV1(message="hi"), job_id="p-1")

    job = Job.objects.get(pk=result.id)
    assert (result.created, result.name, result.job_id) == (True, "jobapp.ping.v1", "p-1")
    assert (job.name, job.payload, job.state) == ("jobapp.ping.v1", {"message": "hi"}, "queued")
    assert (job.queue, job.priority, job.max_attempts, job.tenant) == ("pings", 5, 4, "default")


def test_a_type_this_process_does_not_register_takes_the_settings_defaults():
    with override_settings(JOBS={"DEFAULT_QUEUE": "main", "DEFAULT_MAX_ATTEMPTS": 9}):
        result = jobs.enqueue(SendEmailV1(email_id=EMAIL_ID))

    job = Job.objects.get(pk=result.id)
    assert job.payload == {"email_id": str(EMAIL_ID)}
    assert (job.queue, job.priority, job.max_attempts) == ("main", 0, 9)


def test_explicit_options_win_over_the_policy():
    before = timezone.now()
    result = jobs.enqueue(
        PingV1(message="hi"),
        tenant="acme",
        queue="urgent",
        priority=-3,
        max_attempts=1,
        delay=3600,
    )

    job = Job.objects.get(pk=result.id)
    assert (job.tenant, job.queue, job.priority, job.max_attempts) == ("acme", "urgent", -3, 1)
    assert job.run_after >= before + timedelta(minutes=59)


def test_enqueue_many_shares_options_and_specs_override_them():
    at = timezone.now() + timedelta(days=1)
    results = jobs.enqueue_many(
        [
            PingV1(message="a"),
            JobSpec(payload=AuditV1(entry_id=1), job_id="audit-1", priority=9, delay=0),
            SendEmailV1(email_id=EMAIL_ID),
        ],
        tenant="acme",
        priority=2,
        run_after=at,
    )

    rows = [Job.objects.get(pk=result.id) for result in results]
    assert [row.name for row in rows] == ["jobapp.ping.v1", "jobapp.audit.v1", SendEmailV1.job_name]
    assert [row.tenant for row in rows] == ["acme"] * 3
    assert [row.priority for row in rows] == [2, 9, 2]
    assert [row.max_attempts for row in rows] == [4, 2, 5]
    assert rows[1].job_id == "audit-1"
    assert rows[0].run_after == at and rows[2].run_after == at
    assert rows[1].run_after < at  # its own delay replaced the batch's run_after


def test_an_empty_batch_inserts_nothing():
    assert jobs.enqueue_many([]) == []


def test_repeat_enqueue_returns_the_existing_job():
    first = jobs.enqueue(PingV1(message="a"), job_id="same")
    again = jobs.enqueue(PingV1(message="b"), job_id="same")
    assert (again.id, again.created) == (first.id, False)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            SendEmailV1(email_id=UUID(int=0)),
            "job #1: producer.email.send.v1: invalid payload: email_id must not be the zero UUID",
        ),
        (
            SendEmailV1(email_id="not-a-uuid"),  # type: ignore[arg-type]
            "job #1: producer.email.send.v1: invalid payload: email_id: expected a UUID "
            "string, got 'not-a-uuid'",
        ),
        (
            PingV1(message={1, 2}),  # type: ignore[arg-type]
            "job #1: jobapp.ping.v1: invalid payload: message: cannot encode set as JSON",
        ),
        (
            {"message": "hi"},
            "job #1: expected a Payload or JobSpec, got dict; define the job's payload as a "
            "jobs.Payload subclass",
        ),
        (
            ImpostorPingV1(message="hi"),
            f"job #1: {__name__}.ImpostorPingV1 claims the name jobapp.ping.v1, which is "
            f"registered for tests.jobapp.jobs.PingV1",
        ),
    ],
    ids=["validate", "wrong-type", "not-json", "raw-dict", "impostor"],
)
def test_an_invalid_job_rejects_the_whole_batch(bad, message):
    with pytest.raises(InvalidJob) as info:
        jobs.enqueue_many([PingV1(message="ok"), bad, AuditV1(entry_id=2)])

    assert str(info.value) == message
    assert info.value.index == 1
    assert not Job.objects.exists()


def test_queue_options_are_still_checked_by_the_queue():
    with pytest.raises(InvalidJob, match="priority must be a whole number from -100 to 100"):
        jobs.enqueue(PingV1(message="hi"), priority=500)
    assert not Job.objects.exists()


def test_enqueue_joins_the_callers_transaction():
    with pytest.raises(RuntimeError), transaction.atomic():
        jobs.enqueue(PingV1(message="rolled back"))
        raise RuntimeError("the business write failed")

    assert not Job.objects.exists()


# -- a batch's jobs are what each would be alone ------------------------------------------------

_OPTIONS = {
    "tenant": st.sampled_from([None, "acme", "globex"]),
    "queue": st.sampled_from([None, "bulk"]),
    "priority": st.sampled_from([None, -3, 0, 7]),
    "run_after": st.none(),
    "delay": st.sampled_from([None, 0, 2.5, timedelta(minutes=1)]),
    "max_attempts": st.sampled_from([None, 1, 9]),
    "after": st.sampled_from([None, (), (5, "upstream")]),
    "on_dependency_failure": st.sampled_from([None, "fail"]),
}
_ITEMS = st.one_of(
    st.builds(PingV1, message=st.text(max_size=3)),
    st.builds(AuditV1, entry_id=st.integers(0, 9)),
    st.builds(SendEmailV1, email_id=st.just(EMAIL_ID)),
    st.builds(
        JobSpec,
        payload=st.builds(PingV1, message=st.just("s")) | st.builds(AuditV1, entry_id=st.just(1)),
        job_id=st.sampled_from([None, "k-1"]),
        **_OPTIONS,
    ),
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(_ITEMS, max_size=6), shared=st.fixed_dictionaries(_OPTIONS))
def test_each_job_of_a_batch_is_the_job_it_would_be_alone(items, shared):
    """Options worked out once a type for plain payloads give every job what it would get
    enqueued on its own with the same shared options."""
    batch = new_jobs(items, shared)
    assert batch == [new_jobs([item], shared)[0] for item in items]


# -- a large batch of payloads (inserted by COPY) -----------------------------------------------

_validated: list[int] = []


class CountedV1(Payload, name="producer.counted.v1"):
    """Notes each decode-and-validate the producer runs (its check of every payload)."""

    n: int

    def validate(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")
        _validated.append(self.n)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bad_at", [0, 100, -1])
def test_an_invalid_payload_of_a_large_batch_inserts_nothing(bad_at):
    """Outside a transaction too, where the queue checks its part of each job as the COPY
    streams it: the payloads are all checked first, and one refused inserts nothing."""
    from jobs.queue.enqueue import COPY_AT_LEAST

    items = [CountedV1(n=n) for n in range(COPY_AT_LEAST * 4)]
    items[bad_at] = CountedV1(n=-1)
    with pytest.raises(InvalidJob, match="n must not be negative") as raised:
        jobs.enqueue_many(items)
    assert raised.value.index == range(len(items))[bad_at]
    assert not Job.objects.exists()
    assert len(jobs.enqueue_many([CountedV1(n=n) for n in range(4)])) == 4  # the connection goes on


class HostileMixV1(Payload, name="hostile.mix.v1"):
    n: int
    ratio: float = 0.5


@pytest.mark.django_db
def test_plain_payloads_and_job_specs_of_one_type_keep_their_own_options():
    """The per-type options cache of plain payloads does not leak a JobSpec's own options to the
    plain jobs after it, nor the other way round.
    """
    results = jobs.enqueue_many(
        [
            HostileMixV1(n=0),
            JobSpec(payload=HostileMixV1(n=1, ratio=1.0), priority=9, queue="q9", max_attempts=7),
            HostileMixV1(n=2, ratio=2.5),
        ],
        priority=3,
    )
    rows = {j.pk: j for j in Job.objects.all()}
    got = [(rows[r.id].priority, rows[r.id].queue, rows[r.id].payload) for r in results]
    assert got[1][:2] == (9, "q9") and rows[results[1].id].max_attempts == 7
    assert got[0][0] == got[2][0] == 3 and got[0][1] == got[2][1] != "q9"
    assert [g[2] for g in got] == [
        {"n": 0, "ratio": 0.5},
        {"n": 1, "ratio": 1.0},
        {"n": 2, "ratio": 2.5},
    ]
