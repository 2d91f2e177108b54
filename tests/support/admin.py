"""Operators for the admin's tests: staff users holding exactly the permissions a test names,
logged-in clients, and a web host whose clock runs ahead of the database's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

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
    # Now, on this thread: clients used from several threads at once would otherwise load the
    # middleware on their first requests side by side, and django-prometheus's middleware
    # registers its metrics once a process without a lock.
    client.handler.load_middleware()
    return client
