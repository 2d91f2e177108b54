"""The effect journal's statements (``jobs_effect``), and the lock transactional completion takes.

A step of a job that calls the outside world is journaled in two committed writes, each
fenced by the attempt's claim token::

    (no row) ──record_intent──▶ intent ──record_done(result)──▶ done
                                  │  ▲
                                  └──┘ record_intent again: a later attempt calls again

The fence reads the job row ``FOR SHARE``: while the write runs, no claim or sweep can move
the token on, so a fresh attempt that reads the journal after its claim sees every intent a
stale attempt recorded, and a stale attempt (its token gone) records nothing.

Rows are deleted by :func:`prune` once their job is in neither the jobs table nor its
history: one pass covers the three ways a job row goes (archived past its retention, pruned,
its history partition dropped) without adding work to those statements.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS

from jobs.queue import _db

# The job row, only while this attempt holds it; locked against claims and sweeps meanwhile.
# Found by key: ``state || ''`` keeps the planner off the running index, which, under
# statistics taken when few rows were running, it read whole to find one row, every job the
# fleet holds (as the outcome write did, jobs.queue.outcomes).
_HELD = """
held AS (
    SELECT j.id FROM jobs_job j
    WHERE j.id = %(job)s AND j.claim_token = %(token)s AND j.state || '' = 'running'
    FOR SHARE OF j
)"""


@dataclass(frozen=True, slots=True)
class Journaled:
    """What the journal holds for one step of a job when it is read."""

    key: str
    state: str  # "intent" or "done"
    result: Any
    attempt: int


def read(
    job: int, step: str, *, using: str = DEFAULT_DB_ALIAS
) -> tuple[datetime | None, Journaled | None]:
    """The job row's ``created_at`` (None: not in the jobs table) and the step's journal row."""
    with _db.cursor(using) as cur:
        cur.execute(
            """
            SELECT j.created_at, e.key, e.state, e.result, e.attempt
            FROM (SELECT %(job)s::bigint AS id) wanted
            LEFT JOIN jobs_job j ON j.id = wanted.id
            LEFT JOIN jobs_effect e ON e.job = wanted.id AND e.step = %(step)s
            """,
            {"job": job, "step": step},
        )
        created_at, key, state, result, attempt = cur.fetchone()
    if key is None:
        return created_at, None
    return created_at, Journaled(key, state, _db.load_json(result), attempt)


def record_intent(
    job: int, token: UUID, step: str, key: str, attempt: int, *, using: str = DEFAULT_DB_ALIAS
) -> str | None:
    """Record that ``attempt`` is about to make the step's call; the key the row holds.

    A row left at ``intent`` by an earlier attempt is taken over (its key kept). None when the
    token no longer holds the job, or the step is done already (another attempt finished it,
    which only a lost lease allows).
    """
    with _db.cursor(using) as cur:
        cur.execute(
            f"""
            WITH {_HELD}
            INSERT INTO jobs_effect AS e (job, step, key, state, attempt, started_at)
            SELECT held.id, %(step)s, %(key)s, 'intent', %(attempt)s, statement_timestamp()
            FROM held
            ON CONFLICT (job, step) DO UPDATE SET attempt = EXCLUDED.attempt
            WHERE e.state = 'intent'
            RETURNING e.key
            """,
            {"job": job, "token": token, "step": step, "key": key, "attempt": attempt},
        )
        row = cur.fetchone()
    return None if row is None else str(row[0])


def record_done(
    job: int,
    token: UUID,
    step: str,
    result_json: str,
    attempt: int,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> bool:
    """Record the step's result (JSON text); False if the token no longer holds the job."""
    with _db.cursor(using) as cur:
        cur.execute(
            f"""
            WITH {_HELD}
            UPDATE jobs_effect e
            SET state = 'done', result = %(result)s::jsonb, attempt = %(attempt)s,
                finished_at = statement_timestamp()
            FROM held
            WHERE e.job = held.id AND e.step = %(step)s AND e.state = 'intent'
            RETURNING 1
            """,
            {"job": job, "token": token, "step": step, "result": result_json, "attempt": attempt},
        )
        return cur.fetchone() is not None


def hold(job: int, token: UUID, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Lock the job row for the caller's transaction while ``token`` holds it; False if not.

    Waits for a lock another session holds (a lease renewal, for a moment), then checks the
    token again on the row as committed: the caller's outcome write that follows in the same
    transaction cannot then find the row busy, nor another attempt's. A batch member's batch
    row is locked first, as an add to the batch locks it before the jobs its members wait
    for (at its commit): the other way round, the two could deadlock.
    """
    with _db.cursor(using) as cur:  # by key, as _HELD
        cur.execute(  # COALESCE: see jobs.queue.batches.lock_for
            "SELECT 1 FROM jobs_batch WHERE id = "
            "(SELECT COALESCE(batch_id, 0) FROM jobs_job WHERE id = %s AND claim_token = %s) "
            "FOR NO KEY UPDATE",
            [job, token],
        )
        cur.execute(
            "SELECT 1 FROM jobs_job WHERE id = %s AND claim_token = %s AND state || '' = 'running' "
            "FOR UPDATE",
            [job, token],
        )
        return cur.fetchone() is not None


def prune(
    *,
    older_than: timedelta,
    batch_size: int = 1000,
    max_batches: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Delete journal rows whose job is gone from the jobs table and its history; the count.

    Only rows whose intent is older than ``older_than`` are looked at (the shortest history
    retention: no job row can be gone sooner), oldest first, in bounded batches; call it
    outside a transaction so each batch commits on its own.
    """
    deleted = 0
    with _db.cursor(using) as cur:
        for _batch in range(max_batches):
            cur.execute(
                """
                WITH gone AS (
                    SELECT e.job, e.step FROM jobs_effect e
                    WHERE e.started_at < COALESCE(%(now)s::timestamptz, statement_timestamp())
                                         - make_interval(secs => %(age)s)
                      AND NOT EXISTS (SELECT 1 FROM jobs_job j WHERE j.id = e.job)
                      AND NOT EXISTS (SELECT 1 FROM jobs_jobhistory h WHERE h.id = e.job)
                    ORDER BY e.started_at
                    LIMIT %(batch)s
                    FOR UPDATE SKIP LOCKED
                )
                DELETE FROM jobs_effect e USING gone
                WHERE e.job = gone.job AND e.step = gone.step
                """,
                {"now": now, "age": _db.seconds(older_than), "batch": batch_size},
            )
            count = cur.rowcount
            deleted += count
            if count < batch_size:
                break
    return deleted
