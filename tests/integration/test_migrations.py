"""The jobs app's migrations build exactly the schema described in tests/support/jobs_schema.txt.

Each test migrates a throwaway database of its own (tests/support/schema.py), so what it reads
is what ``migrate`` built from nothing, untouched by other tests.
"""

from __future__ import annotations

import pytest

from tests.support import schema

pytestmark = pytest.mark.slow


@pytest.fixture
def migrated(django_db_blocker):
    """The description of a database ``migrate`` built from nothing."""
    with django_db_blocker.unblock():
        return schema.migrated_schema()


def test_the_migrations_build_the_described_schema(migrated):
    expected = schema.checked_in()
    assert set(migrated) == set(expected), "objects missing or added"
    assert [key for key in expected if migrated[key] != expected[key]] == []
