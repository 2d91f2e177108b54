"""Statements that find jobs by id look at those rows only, whatever the statistics say.

PostgreSQL plans from the table's statistics as the last ANALYZE left them. Taken when few
rows were in some state, they make that state's partial index look empty, and a lookup by id
that also filters on the state reads that index whole instead of the primary key: every job
the fleet holds, every queued or finished one, to find a few (with 5,000 running, 1.3 ms a
call instead of a few µs). The statements test the state as ``state || ''`` (and a held key
as ``key_held IS TRUE``), which no partial index's predicate matches.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from jobs import queue
from jobs.models import Job
from jobs.queue import AllTenants, ClaimRequest, NewJob, Outcome, effects, history, keys
from jobs.queue.renewal import next_attempt
from tests.integration.test_pass_scale import BACKLOG, NAME, _scans, mine_among_others
from tests.integration.test_review_round22 import explained_nested_statements
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
        for scan in _scans(plan["Plan"])
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
    reads = [scan.get("Index Name", scan["Node Type"]) for scan in _scans(plan["Plan"])]
    assert "jobs_job_terminal" not in reads, reads


def _source(function: str) -> str | None:
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [function])
        row = cur.fetchone()
    return None if row is None else row[0]


def test_the_settle_migrations_go_both_ways():
    """0024 made the settle function read waiting jobs by key; 0025 replaced it with the
    release function, which reads them by key too."""
    assert _source("jobs_dependents_settle") is None
    assert _source("jobs_dependents_release").count("j.state || '' = 'queued'") == 2
    try:
        call_command("migrate", "jobs", "0024", verbosity=0)
        assert _source("jobs_dependents_release") is None
        assert _source("jobs_dependents_settle").count("j.state || '' = 'queued'") == 4
        call_command("migrate", "jobs", "0023", verbosity=0)
        assert "|| ''" not in _source("jobs_dependents_settle")
        assert _source("jobs_dependents_settle").count("j.state = 'queued'") == 4
    finally:
        call_command("migrate", "jobs", verbosity=0)
    assert _source("jobs_dependents_settle") is None
    assert _source("jobs_dependents_release").count("j.state || '' = 'queued'") == 2
