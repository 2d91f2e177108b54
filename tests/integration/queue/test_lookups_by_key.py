"""Statements that find jobs by id look at those rows only, whatever the statistics say.

PostgreSQL plans from the table's statistics as the last ANALYZE left them. Taken when few
rows were in some state, they make that state's partial index look empty, and a lookup by id
that also filters on the state reads that index whole instead of the primary key: every job
the fleet holds, every queued or finished one, to find a few (with 5,000 running, 1.3 ms a
call instead of a few µs). The statements test the state as ``state || ''`` (and a held key
as ``key_held IS TRUE``), which no partial index's predicate matches. ``state`` and
``key_held`` are NOT NULL and ``state`` compares under a deterministic collation, so the
rewrites test what ``state`` and ``key_held`` did for every value the schema allows.

Plans (auto_explain, actual rows and buffers of every read of the jobs table): the claim
checks, the settle trigger, reckon, replay (its release, key check and restore's undo), the
keyed enqueue's release, run_now, cancel_running and replay's report read a few rows and
pages, under statistics taken when the state they test was empty and under fresh ones. With
the primary key dropped and sequential scans disabled, no rewritten statement can use a
partial index, so no statistics can steer one there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection, transaction

from jobs import queue
from jobs.db.clock import database_now
from jobs.models import Job
from jobs.queue import (
    AllTenants,
    ClaimRequest,
    NewJob,
    Outcome,
    effects,
    history,
    keys,
)
from jobs.queue.renewal import next_attempt
from tests.support.backlog import BACKLOG, NAME, mine_among_others
from tests.support.explain import explained_nested_statements, jobs_table_scans
from tests.support.history import where
from tests.support.keyed_rows import (
    DAY,
    DOWN,
    MINE,
    MINUTE,
    UP,
    end_one,
    enqueue_one,
    insert,
    state_of,
)
from tests.support.workflows import settle

pytestmark = pytest.mark.django_db(transaction=True)

MOST = 5  # rows a lookup of at most three jobs may look at


def rows_examined(plan: dict) -> list:
    """Each read of the jobs table in ``plan``: its index, and the rows it looked at (those
    it returned and those its filter threw away)."""
    return [
        (
            scan.get("Index Name", scan["Node Type"]),
            (scan["Actual Rows"] + scan.get("Rows Removed by Filter", 0)) * scan["Actual Loops"],
        )
        for scan in jobs_table_scans(plan["Plan"])
    ]


def assert_by_key(plans: list[dict]) -> None:
    read = [scan for plan in plans for scan in rows_examined(plan)]
    wide = [
        (" ".join(plan["Query Text"].split()[:14]), rows_examined(plan))
        for plan in plans
        if any(rows > MOST for _, rows in rows_examined(plan))
    ]
    assert read and not wide, wide


def analyze_then_renew_connection() -> None:
    """Statistics of the table as it is now, and plans made afresh from them."""
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")
    connection.close()


def backlog(**fields) -> list:
    return queue.enqueue_many([NewJob(NAME, {"n": n}, **fields) for n in range(BACKLOG)])


def finish_everything(state: str) -> None:
    """Every job of the table ends ``state`` at once, its key let go (no trigger fires: none
    is in a batch or waited for)."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE jobs_job SET state = %s, finished_at = statement_timestamp(), "
            "key_held = FALSE, claim_token = NULL, lease_expires_at = NULL",
            [state],
        )


@pytest.mark.parametrize("path", ["hold", "intent", "done", "next attempt"])
def test_a_handlers_own_row_is_found_by_key_however_many_others_run(path):
    """A handler's calls that check its claim (``jobs.complete``, an effect's journal, a retry
    waited out in the worker) look at its one row, not at the 300 others hold."""
    job = mine_among_others()[0]

    with transaction.atomic(), explained_nested_statements() as plans:
        if path == "hold":
            assert effects.hold(job.id, job.claim_token)
        elif path == "next attempt":
            assert next_attempt(job) == job.attempts + 1
        else:
            key = effects.record_intent(job.id, job.claim_token, "step", "k", job.attempts)
            assert key == "k"
            if path == "done":
                assert effects.record_done(job.id, job.claim_token, "step", "1", job.attempts)
        transaction.set_rollback(True)

    assert_by_key(plans)


def test_run_now_finds_its_jobs_by_key_among_a_backlog_analyzed_while_none_was_queued():
    backlog()
    finish_everything("succeeded")
    analyze_then_renew_connection()
    backlog()
    later = queue.enqueue_many([NewJob(NAME, {}, delay=timedelta(hours=1))] * 3)
    ids = sorted(job.id for job in later)

    with transaction.atomic(), explained_nested_statements() as plans:
        assert queue.run_now(ids) == ids
        transaction.set_rollback(True)

    assert_by_key(plans)


def test_replay_finds_its_jobs_by_key_among_failures_analyzed_while_none_had_failed():
    backlog()
    analyze_then_renew_connection()
    finish_everything("failed")
    ids = sorted(job.id for job in queue.enqueue_many([NewJob(NAME, {})] * 3))
    finish_everything("failed")

    with transaction.atomic(), explained_nested_statements() as plans:
        report = queue.replay(ids, by="test")
        transaction.set_rollback(True)

    assert list(report.replayed) == ids
    assert_by_key(plans)


def test_replay_counts_again_what_a_job_waits_for_by_key_among_a_new_backlog():
    """The replayed job waits again for the job it depended on; the count is written by key
    though the statistics saw no queued job and 30,000 are queued now."""
    backlog()
    finish_everything("succeeded")
    upstream = queue.enqueue_many([NewJob(NAME, {})])[0]
    downstream = queue.enqueue_many([NewJob(NAME, {}, after=(upstream.id,))])[0]
    [held] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants(), worker="w")
    assert held.id == upstream.id
    queue.record([Outcome.failed(held, code="broken")])
    settle()  # the release after the failure
    assert Job.objects.get(pk=downstream.id).state == "cancelled"  # its upstream failed
    analyze_then_renew_connection()
    backlog()

    with transaction.atomic(), explained_nested_statements() as plans:
        report = queue.replay([downstream.id], by="test")
        transaction.set_rollback(True)

    assert list(report.replayed) == [downstream.id]
    assert_by_key(plans)


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_finished_upstream_settles_its_dependents_by_key_among_a_new_backlog(outcome):
    """The release's function keeps its plan for the connection's life: made when no job
    was queued, it read every queued job to find the ones waiting for this one, on every
    success and failure of a job others wait for."""
    backlog()
    finish_everything("succeeded")
    analyze_then_renew_connection()
    upstream = queue.enqueue_many([NewJob(NAME, {})])[0]
    downstream = queue.enqueue_many([NewJob(NAME, {}, after=(upstream.id,))])[0]
    backlog()
    [held] = queue.claim([ClaimRequest(NAME, 1)], scope=AllTenants(), worker="w")
    assert held.id == upstream.id

    with transaction.atomic(), explained_nested_statements() as plans:
        if outcome == "succeeded":
            queue.record([Outcome.succeeded(held)])
        else:
            queue.record([Outcome.failed(held, code="broken")])
        settle()
        settled = Job.objects.get(pk=downstream.id)
        transaction.set_rollback(True)

    assert (settled.state, settled.waiting_on) == (
        ("queued", 0) if outcome == "succeeded" else ("cancelled", 0)
    )
    assert_by_key(plans)


def test_a_held_key_is_released_by_key_among_keys_analyzed_while_none_was_held():
    backlog()
    finish_everything("succeeded")
    analyze_then_renew_connection()
    ids = sorted(job.id for job in backlog()[:3])

    with transaction.atomic(), explained_nested_statements() as plans:
        with connection.cursor() as cur:
            keys.release(cur, ids)  # none is finished, so none lets its key go
        transaction.set_rollback(True)

    assert_by_key(plans)


def test_a_restored_failure_goes_back_to_history_by_key():
    """Replay puts back what it restored and left alone (its key was taken): the statement's
    plan reads those rows by key, not the finished index whole. Planned only: executing it
    needs history partitions for the rows."""
    backlog()
    analyze_then_renew_connection()
    finish_everything("failed")
    with connection.cursor() as cur:
        cur.execute("SELECT id FROM jobs_job ORDER BY id LIMIT 3")
        ids = [id_ for (id_,) in cur.fetchall()]
        cur.execute("EXPLAIN (FORMAT JSON) " + history.UNRESTORE, {"ids": ids})
        [[[plan]]] = cur.fetchall()
    reads = [scan.get("Index Name", scan["Node Type"]) for scan in jobs_table_scans(plan["Plan"])]
    assert "jobs_job_terminal" not in reads, reads


def _source(function: str) -> str | None:
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [function])
        row = cur.fetchone()
    return None if row is None else row[0]


def test_the_release_function_reads_the_waiting_jobs_by_key():
    assert _source("jobs_dependents_release").count("j.state || '' = 'queued'") == 2


KEYED_BACKLOG = 20_000


BACKLOG_NAME = "test.by_key.backlog.v1"


FEW_ROWS = 10  # rows a read of a few jobs may look at


BLOCKS = 40  # pages it may touch (a whole index of the backlog is well over a hundred)


def make_backlog() -> None:
    """KEYED_BACKLOG queued rows of their own type, each with a key of its own."""
    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO jobs_job (state, attempts, last_error, error_detail, job_id, name, "
            "payload, tenant, queue, priority, max_attempts, run_after, claimed_by, key_held, "
            "replayed_by, keyed) "
            "SELECT 'queued', 0, '', '', 'by-key-backlog-' || g, %s, '{}', 'default', 'default', "
            "0, 5, statement_timestamp(), '', TRUE, '', TRUE FROM generate_series(1, %s) g",
            [BACKLOG_NAME, KEYED_BACKLOG],
        )


_BACKLOG_AS = {
    "queued": "state = 'queued', key_held = TRUE, finished_at = NULL, claim_token = NULL, "
    "lease_expires_at = NULL",
    "running": "state = 'running', key_held = TRUE, finished_at = NULL, "
    "claim_token = gen_random_uuid(), lease_expires_at = statement_timestamp() + interval '1 h'",
    "succeeded, held": "state = 'succeeded', key_held = TRUE, finished_at = statement_timestamp(), "
    "claim_token = NULL, lease_expires_at = NULL",
    "succeeded, let go": "state = 'succeeded', key_held = FALSE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
    "failed, held": "state = 'failed', key_held = TRUE, finished_at = statement_timestamp(), "
    "claim_token = NULL, lease_expires_at = NULL",
    "failed, held past its window": "state = 'failed', key_held = TRUE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
    "failed, let go": "state = 'failed', key_held = FALSE, "
    "finished_at = statement_timestamp() - interval '2 days', claim_token = NULL, "
    "lease_expires_at = NULL",
}


def backlog_as(kind: str, extra: str = "") -> None:
    """Every backlog row in one state at once (none is waited for or in a batch: no trigger)."""
    with connection.cursor() as cur:
        cur.execute(
            f"UPDATE jobs_job SET {_BACKLOG_AS[kind]}{extra} WHERE name = %s", [BACKLOG_NAME]
        )


def analyze_then_reconnect() -> None:
    """Statistics of the table as it is now; plans (and plpgsql's kept plans) made afresh."""
    with connection.cursor() as cur:
        cur.execute("VACUUM ANALYZE jobs_job")
    connection.close()


@pytest.fixture
def no_autoanalyze():
    """Autovacuum would analyze the table after the backlog's updates (1 % churn) and make
    statistics meant to be stale fresh; kept off for the test, put back after."""
    with connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job SET (autovacuum_enabled = off)")
    yield
    with connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job RESET (autovacuum_enabled)")


@contextmanager
def explained() -> Iterator[list[dict]]:
    """The plans, with actual rows and buffers, of every statement (nested ones too) run
    meanwhile, in a transaction rolled back after."""
    with transaction.atomic(), explained_nested_statements() as plans:
        yield plans
        transaction.set_rollback(True)


def _scans(node: dict) -> list[dict]:
    # A read of the table, not a write (whose pages are those of its new rows and entries).
    own = (
        [node]
        if node.get("Relation Name") == "jobs_job" and node["Node Type"] != "ModifyTable"
        else []
    )
    return own + [scan for child in node.get("Plans", []) for scan in _scans(child)]


def reads(plan: dict) -> list[tuple[str, float, int]]:
    """Each read of the jobs table: its index, the rows it looked at (returned and thrown away
    by its filter, over all its loops) and the pages it touched."""
    return [
        (
            scan.get("Index Name", scan["Node Type"]),
            (scan.get("Actual Rows", 0) + scan.get("Rows Removed by Filter", 0))
            * scan.get("Actual Loops", 1),
            scan.get("Shared Hit Blocks", 0) + scan.get("Shared Read Blocks", 0),
        )
        for scan in _scans(plan["Plan"])
    ]


def assert_read_by_key(plans: list[dict]) -> None:
    every = [read for plan in plans for read in reads(plan)]
    wide = [
        (" ".join(plan["Query Text"].split()[:12]), reads(plan))
        for plan in plans
        if any(rows > FEW_ROWS or blocks > BLOCKS for _, rows, blocks in reads(plan))
    ]
    assert every and not wide, wide
    # And none of them on a partial index, however few rows it read there.
    partial = [
        (" ".join(plan["Query Text"].split()[:12]), name)
        for plan in plans
        for name in _indexes(plan["Plan"])
        if name in PARTIAL
    ]
    assert partial == []


@pytest.mark.django_db
def test_state_and_key_held_allow_no_value_for_which_the_rewrites_test_otherwise():
    with connection.cursor() as cur:
        cur.execute(
            "SELECT a.attname, a.attnotnull, format_type(a.atttypid, a.atttypmod), "
            "COALESCE(c.collisdeterministic, TRUE) FROM pg_attribute a "
            "LEFT JOIN pg_collation c ON c.oid = a.attcollation "
            "WHERE a.attrelid = 'jobs_job'::regclass "
            "AND a.attname IN ('state', 'key_held', 'tenant', 'job_id') ORDER BY a.attname"
        )
        assert cur.fetchall() == [
            ("job_id", True, "character varying(255)", True),
            ("key_held", True, "boolean", True),
            ("state", True, "character varying(16)", True),
            ("tenant", True, "character varying(64)", True),
        ]
        # Every state a row may have, and a few it may not: the rewrite and the original agree.
        cur.execute(
            "SELECT s, t FROM unnest(ARRAY['queued', 'running', 'succeeded', 'failed', "
            "'cancelled', 'queued ', 'Queued', '']::varchar(16)[]) AS s, "
            "unnest(ARRAY['queued', 'running', 'succeeded', 'failed', 'cancelled']) AS t "
            "WHERE (s || '' = t) IS DISTINCT FROM (s = t) "
            "   OR ((s || '') IN ('failed', 'cancelled'))"
            "      IS DISTINCT FROM (s IN ('failed', 'cancelled'))"
        )
        assert cur.fetchall() == []
        cur.execute(
            "SELECT b FROM (VALUES (TRUE), (FALSE)) v(b) WHERE (b IS TRUE) IS DISTINCT FROM b"
        )
        assert cur.fetchall() == []


STALE_AND_FRESH = {
    # (statistics taken with the backlog, then the backlog becomes)
    "running": [("queued", "running"), ("running", "running")],
    "queued": [("succeeded, let go", "queued"), ("queued", "queued")],
    "keys": [
        ("queued", "succeeded, held"),  # no finished row when analyzed
        ("succeeded, let go", "failed, held"),  # no key held when analyzed
        ("failed, let go", "failed, held past its window"),
        ("succeeded, held", "succeeded, held"),  # fresh
        ("failed, held past its window", "failed, held past its window"),  # fresh
    ],
}


def _ids(pairs):
    return [f"analyzed {a}, now {b}" if a != b else f"fresh, {b}" for a, b in pairs]


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["running"], ids=_ids(STALE_AND_FRESH["running"])
)
def test_a_handlers_claim_checks_read_its_rows_by_key(no_autoanalyze, analyzed, now):
    make_backlog()
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)
    queue.enqueue_many([NewJob(MINE, {})] * 3)
    held = queue.claim([ClaimRequest(MINE, 3)], scope=AllTenants(), worker="test-worker")
    assert len(held) == 3

    with explained() as plans:
        assert all(effects.hold(job.id, job.claim_token) for job in held)
        job = held[0]
        assert effects.record_intent(job.id, job.claim_token, "step", "k", job.attempts) == "k"
        assert effects.record_done(job.id, job.claim_token, "step", "1", job.attempts)
        assert next_attempt(held[1]) == held[1].attempts + 1

    assert_read_by_key(plans)


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["queued"], ids=_ids(STALE_AND_FRESH["queued"])
)
def test_settles_and_reckon_read_the_waiting_jobs_by_key(no_autoanalyze, analyzed, now):
    make_backlog()
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)
    up, other = enqueue_one(), enqueue_one(job_id="other")
    one = enqueue_one(DOWN, after=(up,))
    two = enqueue_one(DOWN, after=(up, other), on_dependency_failure="fail")
    [held] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants(), worker="test-worker")
    assert held.id == up

    with explained() as succeeded:
        queue.record([Outcome.succeeded(held)])
        settle()
        assert (state_of(one)[:2], state_of(two)[:2]) == (("queued", 0), ("queued", 1))
    with explained() as failed:
        queue.record([Outcome.failed(held, code="broken")])
        settle()
        assert (state_of(one)[0], state_of(two)[0]) == ("cancelled", "failed")
    queue.record([Outcome.failed(held, code="broken")])
    settle()
    with explained() as replayed:
        assert queue.replay([two], by="operator").replayed == (two,)
        settle()
        # Ended again by reckon; keyless, it holds no key.
        assert state_of(two) == ("failed", 0, False, "dependency_failed")

    for plans in (succeeded, failed, replayed):
        assert_read_by_key(plans)


@pytest.mark.parametrize(
    ("analyzed", "now"), STALE_AND_FRESH["keys"], ids=_ids(STALE_AND_FRESH["keys"])
)
def test_replay_and_the_keyed_release_read_rows_and_keys_by_key(no_autoanalyze, analyzed, now):
    """Replay of five failures, three of whose keys are held past their window (released),
    two within it (left alone; one was restored from history and goes back); the keyed
    enqueue's release of the expired holders."""
    make_backlog()
    with connection.cursor() as cur:
        back = insert(cur, "key-5", "failed", held=False, age=2 * MINUTE)
    history.archive(now=database_now())
    assert where(back) == "history"
    with connection.cursor() as cur:
        targets = [insert(cur, f"key-{i}", "failed", held=False, age=3 * DAY) for i in range(4)]
        targets.append(back)
        holders = [
            insert(cur, "key-0", "failed", held=True, age=10 * MINUTE),
            insert(cur, "key-1", "succeeded", held=True, age=2 * DAY),
            insert(cur, "key-2", "cancelled", held=True, age=10 * MINUTE),
            insert(cur, "key-3", "failed", held=True, age=5.0),
            insert(cur, "key-5", "succeeded", held=True, age=5.0),
        ]
    backlog_as(analyzed)
    analyze_then_reconnect()
    backlog_as(now)

    with explained() as replay_plans:
        report = queue.replay(targets, by="operator")
        assert report.replayed == tuple(targets[:3])
        assert report.key_taken == tuple(sorted((targets[3], back)))
        assert where(back) == "history"
        kept = Job.objects.filter(pk__in=holders, key_held=True).values_list("pk", flat=True)
        assert sorted(kept) == holders[3:]
    with explained() as release_plans, connection.cursor() as cur:
        assert keys.release(cur, holders) == set(holders[:3])

    assert_read_by_key(replay_plans)
    assert_read_by_key(release_plans)
    # A read of the restore's undo was among them (the row went back to history).
    assert any("DELETE FROM jobs_job j" in plan["Query Text"] for plan in replay_plans)


PARTIAL = frozenset(
    {
        "jobs_job_claim",
        "jobs_job_tenant_claim",
        "jobs_job_running",
        "jobs_job_retrying",
        "jobs_job_out_of_attempts",
        "jobs_job_terminal",
        "jobs_job_batch",
    }
)


REWRITTEN = {
    # a piece of each rewritten statement's text: the statement it names ran
    "effects.hold": "SELECT 1 FROM jobs_job WHERE id =",
    "effects._HELD": "held AS (",
    "next_attempt": "WITH bumped AS (",
    "keys.release": "UPDATE jobs_job AS j SET key_held = FALSE WHERE",
    "keys.release_for": "CROSS JOIN LATERAL",
    "replay": "WITH target AS (",
    "reckon": "FROM unnest(",
    "history.UNRESTORE": "WITH back AS (",
    "release, success": "released AS (",
    "release, failure": "ended AS (",
}


def _indexes(node: dict) -> list[str]:
    own = [node["Index Name"]] if "Index Name" in node else []
    return own + [name for child in node.get("Plans", []) for name in _indexes(child)]


def test_no_rewritten_lookup_can_use_a_partial_index_whatever_the_statistics():
    """With the primary key dropped and sequential scans disabled, the planner takes any index
    it may use (PostgreSQL 18 counts disabled nodes first): every rewritten statement then
    reads the table sequentially or by the key lock, so no partial index's predicate is
    implied by ``state || ''`` or ``key_held IS TRUE``, under any statistics."""
    with connection.cursor() as cur:
        # A replay from history whose key is taken; one releasing an expired holder.
        back = insert(cur, "taken", "failed", held=False, age=2 * MINUTE)
    history.archive(now=database_now())
    with connection.cursor() as cur:
        insert(cur, "taken", "succeeded", held=True, age=5.0)
        freed = insert(cur, "free", "failed", held=False, age=3 * DAY)
        holder = insert(cur, "free", "failed", held=True, age=10 * MINUTE)
    # A failed job waited for, and a replayed waiting job reckoned against it and ended again.
    failing = enqueue_one(job_id="failing")
    ended = enqueue_one(DOWN, after=(failing,))
    end_one(UP, "failed")
    assert state_of(ended)[0] == "cancelled"
    # A running job waited for by another, and a handler's running job.
    up = enqueue_one(job_id="up")
    waiting = enqueue_one(DOWN, after=(up,))
    [upstream] = queue.claim([ClaimRequest(UP, 1)], scope=AllTenants(), worker="test-worker")
    queue.enqueue(NewJob(MINE, {}))
    [mine] = queue.claim([ClaimRequest(MINE, 1)], scope=AllTenants(), worker="test-worker")

    with explained() as plans, connection.cursor() as cur:
        cur.execute("ALTER TABLE jobs_job DROP CONSTRAINT jobs_job_pkey")
        cur.execute("SET LOCAL enable_seqscan = off")
        assert effects.hold(mine.id, mine.claim_token)
        assert effects.record_intent(mine.id, mine.claim_token, "s", "k", mine.attempts) == "k"
        assert next_attempt(mine) == mine.attempts + 1
        with transaction.atomic():
            assert keys.release(cur, [holder]) == {holder}
            transaction.set_rollback(True)
        with transaction.atomic():
            queue.record([Outcome.succeeded(upstream)])
            settle()
            assert state_of(waiting)[:2] == ("queued", 0)
            transaction.set_rollback(True)
        queue.record([Outcome.failed(upstream, code="broken")])
        settle()
        assert state_of(waiting)[0] == "cancelled"
        report = queue.replay([freed, back, ended], by="operator")
        settle()
        assert (report.replayed, report.key_taken) == ((freed, ended), (back,))
        assert state_of(ended)[0] == "cancelled" and where(back) == "history"

    texts = [" ".join(plan["Query Text"].split()) for plan in plans]
    assert [what for what, piece in REWRITTEN.items() if not any(piece in t for t in texts)] == []
    partial = [
        (" ".join(plan["Query Text"].split()[:12]), name)
        for plan in plans
        for name in _indexes(plan["Plan"])
        if name in PARTIAL
    ]
    assert partial == []


def test_run_now_reads_its_jobs_by_key_among_a_delayed_backlog(no_autoanalyze):
    make_backlog()
    backlog_as("succeeded, let go")
    analyze_then_reconnect()
    backlog_as(
        "queued", ", run_after = statement_timestamp() + interval '1 hour' + id * interval '1 s'"
    )
    ids = sorted(Job.objects.filter(name=BACKLOG_NAME).values_list("pk", flat=True)[:3])

    with explained() as plans:
        assert queue.run_now(ids) == ids

    assert_read_by_key(plans)


def test_cancel_running_reads_its_jobs_by_key_among_the_fleets(no_autoanalyze):
    make_backlog()
    backlog_as("queued")
    analyze_then_reconnect()
    backlog_as("running")
    ids = sorted(Job.objects.filter(name=BACKLOG_NAME).values_list("pk", flat=True)[:3])

    with explained() as plans:
        assert queue.cancel_running(ids, by="operator") == ids

    assert_read_by_key(plans)


def test_a_replay_that_replays_every_job_reads_no_running_rows(no_autoanalyze):
    make_backlog()
    backlog_as("queued")
    analyze_then_reconnect()
    backlog_as("running")
    with connection.cursor() as cur:
        ids = [insert(cur, f"again-{i}", "failed", held=False, age=3 * DAY) for i in range(3)]

    with explained() as plans:
        assert queue.replay(ids, by="operator").replayed == tuple(ids)

    assert_read_by_key(plans)
