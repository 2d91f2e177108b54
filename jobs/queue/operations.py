"""Operator actions on jobs: replay failed work, cancel queued or running work, run delayed
work now.

Each action is one conditional statement over a set of ids that only touches eligible rows,
so a double click or two operators at once act once: the second statement finds nothing left
to change.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import DEFAULT_DB_ALIAS, IntegrityError, transaction

from jobs.queue import _db, attempts, batches, dependencies, flow, history, keys, rollup
from jobs.queue import bound as binding
from jobs.queue.types import ReplayReport
from jobs.runs import ErrorCode

# The rows by key: ``state || ''`` matches no partial index's predicate, and ``OFFSET 0`` keeps
# the key check a look-up in the key lock for each row, which the planner would otherwise turn
# into a join reading the key lock whole when its statistics were taken while few keys were
# held (jobs.queue.keys).
_REPLAY = (
    """
WITH target AS (
    SELECT j.id FROM jobs_job j
    WHERE j.id = ANY(%(ids)s) AND (j.state || '') IN ('failed', 'cancelled')
      AND NOT EXISTS (
          SELECT 1 FROM jobs_job o
          WHERE o.tenant = j.tenant AND o.job_id = j.job_id AND o.key_held AND o.id <> j.id
          OFFSET 0
      )
    FOR UPDATE OF j
)
UPDATE jobs_job j
SET state = 'queued', attempts = 0, run_after = statement_timestamp(), key_held = j.keyed,
    fair = """
    + flow.FAIR_AT_ENQUEUE.format(name="j.name")
    + """,
    started_at = NULL, finished_at = NULL, heartbeat_at = NULL, result = NULL,
    replayed_at = statement_timestamp(), replayed_by = %(by)s,
    cancel_requested_at = NULL, cancel_requested_by = '',
    -- The run's last attempt is in the columns cleared here: keep it in the log.
    attempt_log = CASE WHEN """
    + attempts.unlogged_last_sql("j")
    + """
        THEN j.attempt_log || """
    + attempts.entry_sql(
        row="j",
        outcome="j.state",
        code="j.last_error",
        error="j.error_detail",
        ended="j.finished_at",
    )
    + """
        ELSE j.attempt_log END
FROM target WHERE j.id = target.id
RETURNING j.id
"""
)


def replay(ids: Iterable[int], *, by: str, using: str = DEFAULT_DB_ALIAS) -> ReplayReport:
    """Send failed or cancelled jobs back to the queue with a fresh set of attempts.

    The same row runs again (its id, job_id and payload are kept, ``last_error`` stays as
    the reason it failed until it runs), and who replayed it and when is recorded. A row
    already in the history table moves back to the jobs table first, in the same transaction.
    A job whose job_id was taken by newer work since it failed is left alone, where it was
    (``key_taken``); a finished one that did not fail is ``not_failed``.
    """
    wanted = sorted(set(ids))
    if not wanted:
        return ReplayReport((), (), ())
    with transaction.atomic(using=using), _db.cursor(using) as cur:
        batches.lock_for(cur, wanted)  # before the rows: see batches.lock_for
        # Wait for an archive pass moving any of these rows to commit, so the next statement
        # finds each row in one table or the other, never in neither.
        cur.execute("SELECT id FROM jobs_job WHERE id = ANY(%s) FOR UPDATE", [wanted])
        # Finished jobs may have moved to the history table: bring them back under their ids.
        cur.execute(history.RESTORE, {"ids": wanted})
        restored = {id_ for (id_,) in cur.fetchall()}
        keys.release_for(cur, wanted)
        try:
            with transaction.atomic(using=using):
                cur.execute(_REPLAY, {"ids": wanted, "by": by})
                replayed = {id_ for (id_,) in cur.fetchall()}
        except IntegrityError:
            # Two of the rows share a key: replay one at a time, the first one wins.
            replayed = set()
            for id_ in wanted:
                try:
                    with transaction.atomic(using=using):
                        cur.execute(_REPLAY, {"ids": [id_], "by": by})
                        replayed.update(i for (i,) in cur.fetchall())
                except IntegrityError:
                    continue  # a concurrent enqueue took the key: reported as key_taken
        # A release still pending from how a replayed job ended applies to the jobs that
        # waited for it then, not to those enqueued after it from now on.
        dependencies.replayed(cur, replayed)
        # A replayed job that waited for others waits again for those not succeeded.
        dependencies.reckon(cur, replayed)
        binding.replayed(replayed, using=using)
        if restored - replayed:
            cur.execute(history.UNRESTORE, {"ids": sorted(restored - replayed)})
        rest_ids = [id_ for id_ in wanted if id_ not in replayed]
        rest = []
        if rest_ids:  # with none, id = ANY('{}') could be planned on a partial index read whole
            cur.execute(
                "SELECT id, state IN ('failed', 'cancelled') FROM jobs_job "
                "WHERE id = ANY(%(ids)s) "
                f"UNION ALL SELECT id, state IN ('failed', 'cancelled') FROM {history.PARENT} "
                "WHERE id = ANY(%(ids)s)",
                {"ids": rest_ids},
            )
            rest = cur.fetchall()
    return ReplayReport(
        replayed=tuple(id_ for id_ in wanted if id_ in replayed),
        not_failed=tuple(sorted(id_ for id_, eligible in rest if not eligible)),
        key_taken=tuple(sorted(id_ for id_, eligible in rest if eligible)),
    )


# Ends queued jobs and asks running ones to stop, in one statement: a job that moves between
# the two states meanwhile (a retry, a hand-back) is re-read after its row lock and handled
# in the state it reached, so it is never missed between two statements.
_CANCEL = (
    """
WITH changed AS (
UPDATE jobs_job
SET state = CASE WHEN state = 'queued' THEN 'cancelled' ELSE state END,
    key_held = CASE WHEN state = 'queued' THEN FALSE ELSE key_held END,
    finished_at = CASE WHEN state = 'queued' THEN statement_timestamp() ELSE finished_at END,
    last_error = CASE WHEN state = 'queued' THEN %(code)s ELSE last_error END,
    error_detail = CASE WHEN state = 'queued' THEN 'cancelled by ' || %(by)s
                        ELSE error_detail END,
    cancel_requested_at = CASE WHEN state = 'running' THEN statement_timestamp()
                               ELSE cancel_requested_at END,
    cancel_requested_by = CASE WHEN state = 'running' THEN %(by)s ELSE cancel_requested_by END
WHERE id = ANY(%(ids)s) AND (state || '') = ANY(%(states)s)
  AND (state = 'queued' OR cancel_requested_at IS NULL)
RETURNING id, state, name
),"""
    # Jobs cancelled before they ran, in the console's history (no run or queue time).
    + rollup.cte(
        "SELECT name, 'cancelled', %(code)s, NULL::float8, NULL::float8 FROM changed "
        "WHERE state = 'cancelled'"
    )
    + f"\nSELECT id, state FROM changed WHERE {rollup.reads()}"
)


def cancel(ids: Iterable[int], *, by: str, using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Cancel queued jobs (running ones are left alone); their job_id is released at once.

    Rows of run tables bound to the jobs (``Policy(run_model=…)``) are cancelled with them.
    """
    return cancel_active(ids, by=by, running=False, using=using)[0]


def cancel_running(ids: Iterable[int], *, by: str, using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Ask running jobs to stop; returns the ids asked (running, and not asked before).

    The worker holding a job learns of it at its next lease renewal (a third of the lease at
    most), sets the handler's cancellation flag, and the attempt ends ``cancelled``: not
    retried, its key kept through ``FAILURE_WINDOW`` as after a failure. A handler that ignores
    the flag holds its slot until it returns, as one that overran its deadline does; its
    outcome is still ``cancelled``. If the worker died meanwhile, the expired lease ends the
    job ``cancelled`` instead of retrying it. An attempt that finished before its worker
    learned keeps its outcome (the work was done, or failed for good).
    """
    return cancel_active(ids, by=by, queued=False, using=using)[1]


def cancel_active(
    ids: Iterable[int],
    *,
    by: str,
    queued: bool = True,
    running: bool = True,
    using: str = DEFAULT_DB_ALIAS,
) -> tuple[list[int], list[int]]:
    """End the queued jobs among ``ids`` and ask the running ones to stop, in one statement.

    Returns ``(ended, asked)``. See :func:`cancel` and :func:`cancel_running`.
    """
    wanted = sorted(set(ids))
    states = [s for s, on in (("queued", queued), ("running", running)) if on]
    if not wanted or not states:
        return [], []
    with transaction.atomic(using=using), _db.cursor(using) as cur:
        batches.lock_for(cur, wanted)  # before the rows: see batches.lock_for
        cur.execute(
            _CANCEL,
            {"ids": wanted, "states": states, "by": by[:150], "code": ErrorCode.CANCELLED},
        )
        rows = cur.fetchall()
        ended = sorted(id_ for id_, state in rows if state == "cancelled")
        asked = sorted(id_ for id_, state in rows if state == "running")
        binding.cancelled(ended, by=by, using=using)
    return ended, asked


def run_now(ids: Iterable[int], *, using: str = DEFAULT_DB_ALIAS) -> list[int]:
    """Make queued jobs due now (skip a scheduled delay or retry backoff).

    A job waiting for others (``after=``) is left waiting: it runs when they have succeeded.
    """
    wanted = sorted(set(ids))
    if not wanted:
        return []
    with _db.cursor(using) as cur:
        cur.execute(
            """
            UPDATE jobs_job SET run_after = statement_timestamp()
            WHERE id = ANY(%(ids)s) AND state || '' = 'queued'
              AND run_after > statement_timestamp()
              AND waiting_on = 0
            RETURNING id
            """,
            {"ids": wanted},
        )
        return sorted(id_ for (id_,) in cur.fetchall())
