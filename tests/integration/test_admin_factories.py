"""Factories and helpers the admin, monitor, replay and browser tests share (no tests here).

Rows of the example apps' run tables in any state, and staff users holding exactly the
permissions a test names.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import factory
import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from jobs.models import Job
from jobs.runs import ErrorCode, RunState
from project.curation.models import CurationRun, Document
from project.harvester.models import DeadLetter, Item
from project.mail.models import Delivery
from tests.factories import JobFactory

# Every table the monitor may show, by the permissions that let a user view them.
VIEW_ALL = (
    "jobs.view_job",
    "mail.view_delivery",
    "harvester.view_deadletter",
    "curation.view_curationrun",
)
REPLAY_ALL = (
    "jobs.replay_job",
    "mail.replay_delivery",
    "harvester.replay_deadletter",
    "curation.replay_curationrun",
)


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


def fast_web_clock(
    monkeypatch: pytest.MonkeyPatch, ahead: timedelta = timedelta(minutes=5)
) -> None:
    """From now on the web process's clock runs ``ahead`` of PostgreSQL's (a fast web host).

    Seed rows before calling this, relative to PostgreSQL's ``now()``: pages must not read
    the web host's clock at all, so none of their output may move with it.
    """
    real = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real() + ahead)


def operator(username: str, *perms: str, staff: bool = True, password: str = "") -> User:
    """A user with exactly these permissions (``app_label.codename``)."""
    user = User.objects.create_user(username, password=password or None, is_staff=staff)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


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
