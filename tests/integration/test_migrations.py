"""The jobs app's migrations: the squashed 0001 and 0002 build exactly the schema described in
tests/support/jobs_schema.txt, each later one changes only what it says, and they install the
functions in jobs/queue/sql/functions/.

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


#: The last migration of the squashed set: the file describes the schema up to it.
SQUASHED = "0002_functions"


@pytest.fixture
def squashed(django_db_blocker):
    """The description of a database ``migrate`` built from nothing up to :data:`SQUASHED`."""
    with django_db_blocker.unblock():
        if not schema.comparable():
            pytest.skip(f"the description is PostgreSQL {schema.SERVER_MAJOR}'s catalogue")
        return schema.migrated_schema(SQUASHED)


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


def _installed_again() -> set[str]:
    """The functions a migration after the squashed set installs again. Every migration reads
    a function's file as it is now, so the squashed set installs their latest text too."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    [leaf] = loader.graph.leaf_nodes("jobs")
    again: set[str] = set()
    for app, name in loader.graph.forwards_plan(leaf):
        if app == "jobs" and name > SQUASHED:
            for operation in loader.graph.nodes[(app, name)].operations:
                if isinstance(operation, InstallFunctions):
                    again.update(operation.functions)
    return again


@pytest.mark.slow
def test_the_squashed_migrations_build_the_schema_of_the_chain_they_replaced(squashed):
    described = schema.checked_in()
    assert set(described) >= DROPPED, "a dropped function is not in the description"
    expected = {key: value for key, value in described.items() if key not in DROPPED}
    assert sorted(set(squashed) - set(expected)) == [], "objects the description lacks"
    assert sorted(set(expected) - set(squashed)) == [], "objects the migrations did not build"
    again = _installed_again()
    differ = [key for key in expected if squashed[key] != expected[key]]
    assert [key for key in differ if key.split("(")[0].removeprefix("function ") not in again] == []


#: The history table and its partitions, one for each way a job ends.
HISTORY_TABLES = [f"jobs_jobhistory{part}" for part in ("", "_cancelled", "_failed", "_succeeded")]

PASS_ARGUMENTS = (
    "boolean,bigint[],uuid[],text[],text[],text[],double precision[],timestamp with time "
    "zone[],integer[],jsonb[],jsonb[],text[],integer[],integer[],integer,double precision,text,"
    "text,text"
)
FAIR_PASS_ARGUMENTS = (
    "bigint[],uuid[],text[],text[],text[],double precision[],timestamp with time zone[],"
    "integer[],jsonb[],jsonb[],text[],integer[],integer[],integer[],integer[],double precision[],"
    "double precision[],double precision[],double precision[],boolean[],boolean[],text[],"
    "double precision[],integer,double precision,text,text,text"
)

#: What each migration after the squashed set changes in the description: key -> the new
#: definition (None: the object is gone).
CHANGES: dict[str, str | None] = {
    # 0003: a job that waits for others has no due time; only such a job has none.
    "column jobs_job.run_after": (
        "position 16, timestamp with time zone NULL DEFAULT statement_timestamp()"
    ),
    "constraint jobs_job.jobs_job_run_after_not_null": None,
    "constraint jobs_job.jobs_job_due_or_waiting": (
        "c CHECK (((run_after IS NOT NULL) OR (waiting_on > 0)))"
    ),
    **{
        f"column {table}.run_after": "position 16, timestamp with time zone NULL"
        for table in HISTORY_TABLES
    },
    **{f"constraint {table}.jobs_jobhistory_run_after_not_null": None for table in HISTORY_TABLES},
    # 0004: how far ahead the history is ready, one row per terminal state.
    "table jobs_historyready": "kind r, persistence p, options -",
    "column jobs_historyready.state": "position 1, character varying(16) NOT NULL",
    "column jobs_historyready.until": "position 2, timestamp with time zone NOT NULL",
    "constraint jobs_historyready.jobs_historyready_pkey": "p PRIMARY KEY (state)",
    "constraint jobs_historyready.jobs_historyready_state_not_null": "n NOT NULL state",
    "constraint jobs_historyready.jobs_historyready_until_not_null": "n NOT NULL until",
    "constraint jobs_historyready.jobs_historyready_terminal": (
        "c CHECK (((state)::text = ANY ((ARRAY['succeeded'::character varying, "
        "'failed'::character varying, 'cancelled'::character varying])::text[])))"
    ),
    "index jobs_historyready_pkey": (
        "CREATE UNIQUE INDEX jobs_historyready_pkey ON public.jobs_historyready USING btree (state)"
    ),
    "index jobs_historyready_state_3b42879d_like": (
        "CREATE INDEX jobs_historyready_state_3b42879d_like ON public.jobs_historyready "
        "USING btree (state varchar_pattern_ops)"
    ),
    # 0005: a keyless job holds no key; the pass of a new name, which reads 0004's table
    # (a function's text is the file's, compared by test_the_database_runs_the_functions_in_
    # the_files: here only whether it is installed).
    "function jobs_worker_pass_v3(" + PASS_ARGUMENTS + ")": "installed",
    "function jobs_worker_fair_pass_v3(" + FAIR_PASS_ARGUMENTS + ")": "installed",
    "constraint jobs_job.jobs_job_active_holds_key": None,
    "constraint jobs_job.jobs_job_active_keyed_holds_key": (
        "c CHECK ((key_held OR (NOT ((state)::text = ANY ((ARRAY['queued'::character varying, "
        "'running'::character varying])::text[]))) OR (NOT keyed)))"
    ),
}


@pytest.mark.slow
def test_the_migrations_after_the_squashed_set_change_only_what_they_say(
    squashed, django_db_blocker
):
    with django_db_blocker.unblock():
        latest = schema.migrated_schema()
    changed = {
        key: latest.get(key)
        for key in sorted(set(latest) | set(squashed))
        if latest.get(key) != squashed.get(key)
    }
    changed = {
        key: "installed" if key.startswith("function ") and value is not None else value
        for key, value in changed.items()
    }
    assert changed == CHANGES


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

        # Back one migration and forward: what a later migration installed again stays
        # installed, and jobs of either kind go in and are claimed.
        call_command("migrate", "jobs", "0004", database=alias, verbosity=0)
        queue.enqueue(NewJob(NAME, {"after": "going back"}), using=alias)
        queue.enqueue(NewJob(NAME, job_id="after going back"), using=alias)
        call_command("migrate", "jobs", database=alias, verbosity=0)
        populated["jobs_job"] += 2

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
        assert rebuilt == schema.migrated_schema()


_PLACEHOLDER = "9000-01-01 00:00:00+00"


@pytest.mark.slow
def test_waiting_jobs_lose_the_old_placeholder_date_and_get_it_back_when_reversed(
    django_db_blocker,
):
    with django_db_blocker.unblock(), schema.throwaway_database("placeholder") as alias:
        call_command("migrate", database=alias, verbosity=0)
        call_command("migrate", "jobs", SQUASHED, database=alias, verbosity=0)
        with connections[alias].cursor() as cur:
            # As the squashed set's code left them: a job due now, one waiting for it with the
            # placeholder date, and one that was cancelled while it waited, in the history.
            cur.execute(
                """
                INSERT INTO jobs_job (
                    state, attempts, last_error, error_detail, job_id, name, payload, tenant,
                    queue, priority, max_attempts, run_after, claimed_by, key_held, replayed_by,
                    keyed, waiting_on
                )
                SELECT 'queued', 0, '', '', job_id, %(name)s, '{}', 'default', 'default', 0, 5,
                       run_after, '', TRUE, '', TRUE, waiting_on
                FROM (VALUES ('due', statement_timestamp(), 0),
                             ('waiting', %(placeholder)s::timestamptz, 1))
                     AS v(job_id, run_after, waiting_on)
                """,
                {"name": NAME, "placeholder": _PLACEHOLDER},
            )
            now = database_now(alias)
            history.ensure(cur, "cancelled", now, now)
            cur.execute(
                """
                INSERT INTO jobs_jobhistory (
                    id, state, attempts, last_error, error_detail, finished_at, job_id, name,
                    payload, tenant, queue, priority, max_attempts, run_after, claimed_by,
                    replayed_by
                )
                VALUES (1000000, 'cancelled', 0, 'cancelled', '', %(now)s,
                        'gone', %(name)s, '{}', 'default', 'default', 0, 5, %(placeholder)s,
                        '', '')
                """,
                {"name": NAME, "placeholder": _PLACEHOLDER, "now": now},
            )

        def due_times() -> dict[str, str | None]:
            with connections[alias].cursor() as cur:
                cur.execute(
                    "SELECT job_id, CASE WHEN run_after = %(placeholder)s THEN 'placeholder'"
                    " WHEN run_after IS NOT NULL THEN 'a time' END"
                    " FROM (SELECT job_id, run_after FROM jobs_job"
                    "       UNION ALL SELECT job_id, run_after FROM jobs_jobhistory) t",
                    {"placeholder": _PLACEHOLDER},
                )
                return dict(cur.fetchall())

        assert due_times() == {"due": "a time", "waiting": "placeholder", "gone": "placeholder"}
        call_command("migrate", "jobs", database=alias, verbosity=0)
        assert due_times() == {"due": "a time", "waiting": None, "gone": None}
        call_command("migrate", "jobs", SQUASHED, database=alias, verbosity=0)
        assert due_times() == {"due": "a time", "waiting": "placeholder", "gone": "placeholder"}


@pytest.mark.slow
def test_going_back_to_the_previous_release_keeps_its_workers_pass_working(
    django_db_blocker, monkeypatch
):
    """Rolling the release back (``migrate jobs 0003``) leaves the pass the previous release's
    workers call as it was: 0005 installs the new pass under a new name and drops it going
    back, so the old one never reads what 0004's reversal drops."""
    from jobs.queue import cycle

    with django_db_blocker.unblock(), schema.throwaway_database("previous") as alias:
        call_command("migrate", database=alias, verbosity=0)
        queue.enqueue(NewJob(NAME, {"n": 1}), using=alias)
        call_command("migrate", "jobs", "0003", database=alias, verbosity=0)
        with connections[alias].cursor() as cur:
            cur.execute("SELECT to_regclass('jobs_historyready')")
            assert cur.fetchone() == (None,)  # 0004 reversed
        # The previous release's worker: its function, the same arguments.
        monkeypatch.setattr(cycle, "_PASS_CALL", cycle._PASS_CALL.replace("_v3(", "_v2("))
        report, claimed = queue.record_and_claim(
            [], [ClaimRequest(NAME, 5)], scope=AllTenantsExcept("worker"), count=False, using=alias
        )
        assert len(claimed) == 1
        report, _ = queue.record_and_claim(
            [Outcome.succeeded(claimed[0])],
            [ClaimRequest(NAME, 5)],
            scope=AllTenantsExcept("worker"),
            count=False,
            using=alias,
        )
        assert report.applied == (claimed[0].id,)
