"""factory-boy factories that create rows directly in any state (for arranging tests).

Jobs and tenant overrides, the example apps' run tables, and attempt logs to seed a job's
history of attempts with.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import factory
from django.utils import timezone

from jobs.models import Job, TenantOverride
from jobs.runs import ErrorCode, RunState
from project.curation.models import CurationRun, Document
from project.harvester.models import DeadLetter, Item
from project.mail.models import Delivery


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    job_id = factory.Sequence(lambda n: f"job-{n}")
    name = "test.noop.v1"
    payload = factory.Dict({})
    tenant = "default"
    queue = "default"
    priority = 0
    max_attempts = 5
    state = RunState.QUEUED

    class Params:
        running = factory.Trait(
            state=RunState.RUNNING,
            attempts=1,
            claim_token=factory.LazyFunction(uuid.uuid4),
            lease_expires_at=factory.LazyFunction(lambda: timezone.now() + timedelta(seconds=10)),
            heartbeat_at=factory.LazyFunction(timezone.now),
            started_at=factory.LazyFunction(timezone.now),
            claimed_by="factory",
        )
        succeeded = factory.Trait(
            state=RunState.SUCCEEDED,
            attempts=1,
            finished_at=factory.LazyFunction(timezone.now),
        )
        failed = factory.Trait(
            state=RunState.FAILED,
            attempts=5,
            last_error=ErrorCode.HANDLER_ERROR,
            error_detail="boom",
            finished_at=factory.LazyFunction(timezone.now),
        )


class TenantOverrideFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = TenantOverride

    tenant = factory.Sequence(lambda n: f"tenant-{n}")
    component = "worker"


class _Failed(factory.django.DjangoModelFactory):
    class Meta:
        abstract = True

    state = RunState.FAILED
    last_error = ErrorCode.REJECTED
    error_detail = "it broke"
    finished_at = factory.LazyFunction(timezone.now)


class DeliveryFactory(_Failed):
    class Meta:
        model = Delivery

    to = factory.Sequence(lambda n: f"user{n}@example.com")
    subject = "Hello"
    job_id = factory.Sequence(lambda n: f"mail-{n}")
    attempts = 3


class ItemFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Item

    url = factory.Sequence(lambda n: f"https://news.example/articles/story-{n}")


class DeadLetterFactory(_Failed):
    class Meta:
        model = DeadLetter

    item = factory.SubFactory(ItemFactory)
    job_id = factory.LazyAttribute(lambda o: f"harvest-item-{o.item.pk}")
    attempts = 1


class DocumentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Document

    collection = "articles"
    title = factory.Sequence(lambda n: f"Document {n}")
    body = "Some text."


class CurationRunFactory(_Failed):
    class Meta:
        model = CurationRun

    collection = factory.Sequence(lambda n: f"collection-{n}")
    job_id = factory.LazyAttribute(lambda o: f"curation-{o.collection}")


def ago(**delta: float) -> datetime:
    return timezone.now() - timedelta(**delta)


# A fixed start, so pages can be checked to the second.
ATTEMPTS_START = datetime(2025, 3, 4, 10, 0, 0, tzinfo=UTC)


def two_attempts(start: datetime = ATTEMPTS_START) -> list[dict[str, object]]:
    """An ``attempt_log``: a retried handler error, then a lost lease, from ``start`` on."""

    def at(seconds: float) -> str:
        return (start + timedelta(seconds=seconds)).isoformat()

    return [
        {
            "attempt": 1,
            "started_at": at(0),
            "ended_at": at(1.25),
            "worker": "web-1:101:a1b2",
            "outcome": "retry",
            "code": "handler_error",
            "error": 'Traceback (most recent call last):\n  File "billing.py", line 12\n'
            "ConnectionError: upstream refused the connection",
        },
        {
            "attempt": 2,
            "started_at": at(60),
            "ended_at": at(75),
            "worker": "web-2:202:c3d4",
            "outcome": "lease_expired",
            "code": "lease_expired",
        },
    ]


def job_with_three_attempts(**fields: object) -> Job:
    """A failed job that ran three times: two earlier attempts in its log, the last in its row."""
    start = ATTEMPTS_START
    log = two_attempts(start)
    defaults: dict[str, object] = {
        "job_id": "invoice-42",
        "name": "jobapp.ping.v1",
        "failed": True,
        "attempts": 3,
        "attempt_log": log,
        "claimed_by": "web-1:101:e5f6",
        "started_at": start + timedelta(seconds=300),
        "finished_at": start + timedelta(seconds=300.35),
        "last_error": ErrorCode.HANDLER_ERROR,
        "error_detail": 'Traceback (most recent call last):\n  File "billing.py", line 30\n'
        "ValueError: invoice 42 has no lines",
    }
    return JobFactory(**{**defaults, **fields})
