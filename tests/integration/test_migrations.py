"""The jobs app's migrations: they build exactly the schema described in
tests/support/jobs_schema.txt, and install the functions in jobs/queue/sql/functions/.

The schema tests migrate a throwaway database of their own (tests/support/schema.py), so what
they read is what ``migrate`` built from nothing, untouched by other tests.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.migrations.loader import MigrationLoader

from jobs import queue
from jobs.db.clock import database_now
from jobs.migrations import _functions
from jobs.migrations._functions import InstallFunctions
from jobs.queue import AllTenantsExcept, ClaimRequest, NewJob, Outcome, batches, history, statements
from tests.support import schema

FUNCTIONS = statements.FOLDER / "functions"


@pytest.fixture
def migrated(django_db_blocker):
    """The description of a database ``migrate`` built from nothing."""
    with django_db_blocker.unblock():
        if not schema.comparable():
            pytest.skip(f"the description is PostgreSQL {schema.SERVER_MAJOR}'s catalogue")
        return schema.migrated_schema()


# The description was made from the migrations before they were squashed into 0001 and
# 0002; these functions of that chain were left out of the squashed set, as nothing calls
# them: the pass and pick functions of the release before the _v2 ones (kept for its workers
# during a rolling deploy, and the package has no release yet), and a one-row enqueue
# replaced by jobs_enqueue_job. Regenerating the description empties this list.
DROPPED = {
    "function jobs_enqueue_one(text,text,jsonb,text,text,integer,integer,timestamp with time zone,"
    "double precision,boolean,bigint,integer,timestamp with time zone,text)",
    "function jobs_fair_pick(text,integer,integer,text,double precision,text[],text[],text,text)",
    "function jobs_worker_pass(boolean,bigint[],uuid[],text[],text[],text[],double precision[],"
    "timestamp with time zone[],integer[],jsonb[],jsonb[],text[],integer[],integer[],integer,"
    "double precision,text,text,text)",
    "function jobs_worker_fair_pass(bigint[],uuid[],text[],text[],text[],double precision[],"
    "timestamp with time zone[],integer[],jsonb[],jsonb[],text[],integer[],integer[],integer[],"
    "integer[],double precision[],double precision[],double precision[],double precision[],"
    "boolean[],boolean[],text[],double precision[],integer,double precision,text,text,text)",
}


@pytest.mark.slow
def test_the_migrations_build_the_described_schema(migrated):
    described = schema.checked_in()
    assert set(described) >= DROPPED, "a dropped function is not in the description"
    expected = {key: value for key, value in described.items() if key not in DROPPED}
    assert sorted(set(migrated) - set(expected)) == [], "objects the description lacks"
    assert sorted(set(expected) - set(migrated)) == [], "objects the migrations did not build"
    assert [key for key in expected if migrated[key] != expected[key]] == []


def test_the_latest_migration_naming_each_function_names_its_file_as_it_is():
    """A change to a function's file needs a migration that installs it again: without one,
    databases migrated before the change keep the old function."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    [leaf] = loader.graph.leaf_nodes("jobs")
    named: dict[str, str] = {}
    for key in loader.graph.forwards_plan(leaf):
        for operation in loader.graph.nodes[key].operations if key[0] == "jobs" else ():
            if isinstance(operation, InstallFunctions):
                named.update(operation.functions)
    files = {path.stem: _functions.digest(path.stem) for path in FUNCTIONS.glob("*.sql")}
    assert {name: named.get(name) for name in files} == files


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


# The tables the populated database has rows in, and what the migrations keep there.
TABLES = (
    "jobs_job",
    "jobs_jobhistory",
    "jobs_batch",
    "jobs_dependency",
    "jobs_settlement",
    "jobs_rollup",
    "jobs_pause",
)
NAME = "test.migrations.v1"


def _populate(using: str) -> None:
    """Jobs in every state, a batch, a dependency, an ended job's settlement, history rows in
    partitions made at run time, a rollup and a pause."""
    up = queue.enqueue(NewJob(NAME, job_id="up"), using=using)
    queue.enqueue(NewJob(NAME, {"waits": True}, after=(up.id,)), using=using)
    queue.enqueue_many([NewJob(NAME, {"n": n}) for n in range(20)], using=using)
    batch = batches.open(NewJob(NAME, job_id="after the batch"), using=using)
    batches.add(batch, [NewJob(NAME, {"member": n}) for n in range(3)], using=using)
    batches.seal(batch, using=using)
    held = queue.claim([ClaimRequest(NAME, 10)], scope=AllTenantsExcept("worker"), using=using)
    assert any(job.job_id == "up" for job in held)
    queue.record(
        [Outcome.succeeded(job) for job in held[:8]]
        + [Outcome.failed(job, code="rejected") for job in held[8:]],
        using=using,
    )
    history.archive(now=database_now(using) + timedelta(minutes=1), using=using)
    queue.pause("queue", "paused-queue", by="test", using=using)


def _counts(using: str) -> dict[str, int]:
    with connections[using].cursor() as cur:
        counts = {}
        for table in TABLES:
            cur.execute(f"SELECT count(*) FROM {table}")
            counts[table] = cur.fetchone()[0]
        return counts


@pytest.mark.slow
def test_migrate_goes_back_and_forward_again_on_a_database_with_jobs(django_db_blocker):
    with django_db_blocker.unblock(), schema.throwaway_database("backwards") as alias:
        call_command("migrate", database=alias, verbosity=0)
        _populate(alias)
        populated = _counts(alias)
        assert all(populated.values()), populated

        # Back to the tables alone and forward: the functions go and come back, the rows stay.
        call_command("migrate", "jobs", "0001", database=alias, verbosity=0)
        with connections[alias].cursor() as cur:
            assert not [key for key in schema.describe(cur) if key.startswith("function ")]
        assert _counts(alias) == populated
        call_command("migrate", "jobs", database=alias, verbosity=0)
        report, claimed = queue.record_and_claim(
            [], [ClaimRequest(NAME, 50)], scope=AllTenantsExcept("worker"), count=False, using=alias
        )
        assert claimed and not report.applied

        # Back to nothing, with the rows and the history's partitions, and forward again.
        call_command("migrate", "jobs", "zero", database=alias, verbosity=0)
        with connections[alias].cursor() as cur:
            assert schema.describe(cur) == {}
        call_command("migrate", "jobs", database=alias, verbosity=0)
        with connections[alias].cursor() as cur:
            rebuilt = schema.describe(cur)
        if schema.comparable(alias):
            described = schema.checked_in()
            expected = {key: value for key, value in described.items() if key not in DROPPED}
            assert rebuilt == expected
