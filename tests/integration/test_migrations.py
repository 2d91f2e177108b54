"""The jobs app's migrations: they build exactly the schema described in
tests/support/jobs_schema.txt, and install the functions in jobs/queue/sql/functions/.

The schema tests migrate a throwaway database of their own (tests/support/schema.py), so what
they read is what ``migrate`` built from nothing, untouched by other tests.
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.queue import statements
from tests.support import schema

FUNCTIONS = statements.FOLDER / "functions"


@pytest.fixture
def migrated(django_db_blocker):
    """The description of a database ``migrate`` built from nothing."""
    with django_db_blocker.unblock():
        return schema.migrated_schema()


@pytest.mark.slow
def test_the_migrations_build_the_described_schema(migrated):
    expected = schema.checked_in()
    assert set(migrated) == set(expected), "objects missing or added"
    assert [key for key in expected if migrated[key] != expected[key]] == []


@pytest.mark.django_db
def test_the_database_runs_the_functions_in_the_files():
    with connection.cursor() as cur:
        cur.execute(
            "SELECT proname, prosrc FROM pg_proc "
            "WHERE pronamespace = 'public'::regnamespace AND proname LIKE 'jobs\\_%%'"
        )
        installed = dict(cur.fetchall())
    files = {path.stem: path.read_text().split("$$")[1] for path in FUNCTIONS.glob("*.sql")}
    assert {name: installed.get(name) for name in files} == files
