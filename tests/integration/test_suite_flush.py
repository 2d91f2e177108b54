"""The flush that ends each transactional test (tests/support/flush.py) leaves the tables as
Django's full flush does: every table empty, the content types and permissions as migrate wrote
them. Each test flushes itself, as ``TransactionTestCase`` does, and looks at what is left."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection

from jobs import queue
from jobs.db.clock import database_now
from tests.support.factories import JobFactory
from tests.support.flush import REFERENCE_TABLES

pytestmark = pytest.mark.django_db(transaction=True)


def flush() -> None:
    """What ``TransactionTestCase`` runs after a test."""
    call_command(
        "flush",
        verbosity=0,
        interactive=False,
        reset_sequences=False,
        allow_cascade=False,
        inhibit_post_migrate=False,
    )


def reference_rows() -> tuple[set, set]:
    return (
        set(ContentType.objects.values_list("app_label", "model")),
        set(Permission.objects.values_list("content_type__app_label", "codename", "name")),
    )


def rows_left() -> dict[str, int]:
    """The tables other than the content types and permissions that still hold rows."""
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    left = {}
    with connection.cursor() as cursor:
        for table in set(tables) - set(REFERENCE_TABLES):
            cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(table)}")
            if count := cursor.fetchone()[0]:
                left[table] = count
    return left


def test_every_table_a_test_wrote_is_empty_after_the_flush_partitioned_history_included():
    flush()
    written = reference_rows()
    for _ in range(3):
        JobFactory(failed=True)
    queue.history.archive(now=database_now() + timedelta(minutes=1))  # into its partitions
    JobFactory()
    User.objects.create_user("someone")
    assert rows_left()

    flush()

    assert rows_left() == {}
    assert reference_rows() == written


def test_content_types_and_permissions_a_test_changed_are_written_again():
    flush()
    written = reference_rows()
    Permission.objects.filter(codename="view_job").delete()
    Permission.objects.create(
        codename="extra", name="Extra", content_type=ContentType.objects.get_for_model(User)
    )

    flush()

    assert reference_rows() == written
