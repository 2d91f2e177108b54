"""Batches: a group of jobs, and a successor enqueued once when every member has finished.

A batch row counts its members (``total``) and their terminal outcomes (``succeeded``,
``failed``, ``cancelled``); a member that fails for good or is cancelled has finished as
surely as one that succeeded. The settle trigger (jobs_job_settled) moves the counts in the
transaction of the member's state change, whichever statement makes it, and the change that
settles the last member of a sealed batch inserts the successor, in that same transaction,
once: a worker killed at any point either committed the member's outcome with the successor
or neither. Concurrent members settle one after another on the batch's row lock.

Lifecycle::

    open ──add members (any number of times, from anywhere, until fired)──▶ seal
      every member terminal and sealed ──▶ fired: successor enqueued, fired_at set

A batch is sealed when its creator has added all it meant to (``jobs.batch()`` seals on
leaving its block); until then it cannot fire, however many members have finished. Members
may add members to their own batch while they run: their own outcome comes after, so the
batch cannot fire in between. Replaying a finished member takes it out of the counts until
it finishes again; the successor has run once already and does not run again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.backends.utils import CursorWrapper

from jobs.core.limits import validate_key
from jobs.queue import _db, enqueue, job_rows, keys
from jobs.queue.types import BatchFailure, BatchState, Enqueued, InvalidJob, NewJob

_STATE_COLUMNS = (
    "id, tenant, description, created_at, created_by, sealed_at, total, succeeded, failed, "
    "cancelled, fired_at, successor_pk"
)


class BatchClosed(ValueError):
    """A member was added to a batch whose successor has already been enqueued."""


class BatchNotFound(LookupError):
    """No batch has this id (never made, or deleted by retention)."""


def open(
    successor: NewJob | None = None,
    *,
    tenant: str | None = None,
    description: str = "",
    by: str = "",
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Make an open batch; returns its id. ``successor`` is validated now, enqueued later."""
    if not isinstance(description, str) or len(description) > 200:
        raise InvalidJob("description must be a string of at most 200 characters")
    template = None
    if successor is not None:
        if successor.after or successor.run_after or successor.delay or successor.batch_id:
            raise InvalidJob(
                "a batch's successor runs when the batch finishes: "
                "it takes no after, run_after, delay or batch_id"
            )
        template = job_rows.validated_row(successor)
    values: dict[str, Any] = template or {}
    with _db.cursor(using) as cur:
        cur.execute(
            """
            INSERT INTO jobs_batch (
                tenant, description, created_by, total, succeeded, failed, cancelled, successor
            )
            VALUES (
                %(tenant)s, %(description)s, %(by)s, 0, 0, 0, 0,
                CASE WHEN %(has_successor)s THEN jsonb_build_object(
                    'job_id', %(job_id)s::text, 'keyed', %(keyed)s::boolean,
                    'name', %(name)s::text, 'payload', %(payload)s::jsonb,
                    'tenant', %(s_tenant)s::text, 'queue', %(queue)s::text,
                    'priority', %(priority)s::integer, 'max_attempts', %(max_attempts)s::integer,
                    -- For the firing: a holder of the successor's key whose window has
                    -- passed lets it go, as enqueue lets it go.
                    'success_window', %(success_window)s::float8,
                    'failure_window', %(failure_window)s::float8
                ) END
            )
            RETURNING id
            """,
            {
                "tenant": _tenant(tenant, template),
                "description": description,
                "by": by[:200],
                "has_successor": template is not None,
                "s_tenant": values.get("tenant"),
                **keys.window_params(),
                **{
                    key: values.get(key)
                    for key in (
                        "job_id",
                        "keyed",
                        "name",
                        "payload",
                        "queue",
                        "priority",
                        "max_attempts",
                    )
                },
            },
        )
        [(batch_id,)] = cur.fetchall()
    return int(batch_id)


def add(batch_id: int, jobs: Sequence[NewJob], *, using: str = DEFAULT_DB_ALIAS) -> list[Enqueued]:
    """Enqueue ``jobs`` as members of the batch, in one transaction (the caller's, if any).

    A job whose key another job holds is not added: that job is returned, as enqueue does,
    and the batch does not count it. Raises :class:`BatchClosed` once the successor has been
    enqueued, :class:`BatchNotFound` for an unknown id. Holds the batch's row lock until
    the transaction ends: members finishing meanwhile wait for it, so keep it short.
    """
    if not jobs:
        return []
    with transaction.atomic(using=using), _db.cursor(using) as cur:
        # The batch row first, the jobs the members wait for as the transaction commits
        # (jobs.queue.dependencies): whatever ends a member locks its batch row before the
        # member's own (lock_for), and the worker's pass never waits for a batch row.
        # Count the jobs first: a member may finish inside this very transaction (it waits for
        # a job that has failed), and the counts must never pass the total.
        cur.execute(
            "UPDATE jobs_batch SET total = total + %s WHERE id = %s RETURNING fired_at",
            [len(jobs), batch_id],
        )
        row = cur.fetchone()
        if row is None:
            raise BatchNotFound(f"no batch has id {batch_id}")
        if row[0] is not None:
            raise BatchClosed(
                f"batch {batch_id} has finished (its successor was enqueued): "
                "it takes no more members"
            )
        results = enqueue.enqueue_many(
            [replace(job, batch_id=batch_id) for job in jobs], using=using
        )
        skipped = sum(not result.created for result in results)
        if skipped:
            cur.execute(
                "UPDATE jobs_batch SET total = total - %s WHERE id = %s", [skipped, batch_id]
            )
        # Members that finished in this transaction may have been the last ones.
        cur.execute("SELECT jobs_batch_settle(%s, 0, 0, 0)", [batch_id])
    return results


def lock_for(cur: CursorWrapper, job_ids: Sequence[int]) -> None:
    """Lock the batch rows of these jobs (in either table), in id order, waiting for them.

    Whatever ends a member or brings one back locks its batch's row before the member's own:
    an add to a batch holds the batch's row and, as it commits, locks the jobs its members
    wait for, so the other order could deadlock with it. (The worker's pass never waits for
    a batch row at all: jobs.queue.outcomes.)
    """
    # The rows by key: COALESCE keeps the planner from inferring ``batch_id IS NOT NULL``,
    # the predicate of the batch members' partial index, which it could then read whole.
    cur.execute(
        "SELECT b.id FROM jobs_batch b WHERE b.id IN ("
        " SELECT COALESCE(batch_id, 0) FROM jobs_job WHERE id = ANY(%(ids)s)"
        " UNION SELECT COALESCE(batch_id, 0) FROM jobs_jobhistory WHERE id = ANY(%(ids)s)"
        ") ORDER BY b.id FOR NO KEY UPDATE",
        {"ids": list(job_ids)},
    )


def seal(batch_id: int, *, using: str = DEFAULT_DB_ALIAS) -> bool:
    """Say the creator has added every member; True when this fired the successor.

    A batch whose members have all finished (or that has none) fires here.
    """
    with transaction.atomic(using=using), _db.cursor(using) as cur:
        cur.execute(
            "UPDATE jobs_batch SET sealed_at = COALESCE(sealed_at, statement_timestamp()) "
            "WHERE id = %s RETURNING fired_at IS NULL",
            [batch_id],
        )
        row = cur.fetchone()
        if row is None:
            raise BatchNotFound(f"no batch has id {batch_id}")
        if not row[0]:
            return False
        cur.execute("SELECT jobs_batch_settle(%s, 0, 0, 0)", [batch_id])
        cur.execute("SELECT fired_at IS NOT NULL FROM jobs_batch WHERE id = %s", [batch_id])
        [(fired,)] = cur.fetchall()
    return bool(fired)


def get(batch_id: int, *, using: str = DEFAULT_DB_ALIAS) -> BatchState:
    """The batch's counts as committed now."""
    with _db.cursor(using) as cur:
        cur.execute(f"SELECT {_STATE_COLUMNS} FROM jobs_batch WHERE id = %s", [batch_id])
        row = cur.fetchone()
    if row is None:
        raise BatchNotFound(f"no batch has id {batch_id}")
    return BatchState(*row)


def of_member(job_pk: int, *, using: str = DEFAULT_DB_ALIAS) -> int | None:
    """The batch the job is a member of, if any."""
    with _db.cursor(using) as cur:
        cur.execute(
            "SELECT batch_id FROM jobs_job WHERE id = %(id)s "
            "UNION ALL SELECT batch_id FROM jobs_jobhistory WHERE id = %(id)s LIMIT 1",
            {"id": job_pk},
        )
        row = cur.fetchone()
    return None if row is None or row[0] is None else int(row[0])


def of_successor(job_pk: int, *, using: str = DEFAULT_DB_ALIAS) -> int | None:
    """The batch whose successor the job is, if any."""
    with _db.cursor(using) as cur:
        cur.execute("SELECT id FROM jobs_batch WHERE successor_pk = %s", [job_pk])
        row = cur.fetchone()
    return None if row is None else int(row[0])


def failures(
    batch_id: int, *, limit: int = 1000, using: str = DEFAULT_DB_ALIAS
) -> list[BatchFailure]:
    """Members that failed or were cancelled, oldest first, from the jobs table and history.

    Members pruned by retention are gone from the list; the counts keep them.
    """
    with _db.cursor(using) as cur:
        cur.execute(
            """
            SELECT id, job_id, name, state, last_error, error_detail, finished_at FROM (
                SELECT id, job_id, name, state, last_error, error_detail, finished_at
                FROM jobs_job
                WHERE batch_id = %(batch)s AND state IN ('failed', 'cancelled')
                UNION ALL
                SELECT id, job_id, name, state, last_error, error_detail, finished_at
                FROM jobs_jobhistory
                WHERE batch_id = %(batch)s AND state IN ('failed', 'cancelled')
            ) AS m
            ORDER BY finished_at, id
            LIMIT %(limit)s
            """,
            {"batch": batch_id, "limit": limit},
        )
        return [BatchFailure(*row) for row in cur.fetchall()]


def prune(
    *,
    older_than: timedelta,
    batch_size: int = 1000,
    max_batches: int = 100,
    now: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> int:
    """Delete batches finished ``older_than`` ago, and open ones that age with no member left.

    A batch its creator never sealed (a crash between open and seal) can never fire: once it
    is that old and none of its members is still in the jobs table, it goes too. Members keep
    their ``batch_id``; :meth:`get` of a deleted batch raises :class:`BatchNotFound`.
    """
    deleted = 0
    with _db.cursor(using) as cur:
        for _ in range(max_batches):
            cur.execute(
                """
                WITH gone AS (
                    DELETE FROM jobs_batch WHERE id = ANY(ARRAY(
                        SELECT b.id FROM jobs_batch b
                        WHERE (b.fired_at < COALESCE(%(now)s, statement_timestamp())
                                             - make_interval(secs => %(age)s))
                           OR (b.fired_at IS NULL AND b.sealed_at IS NULL
                               AND b.created_at < COALESCE(%(now)s, statement_timestamp())
                                                  - make_interval(secs => %(age)s)
                               AND NOT EXISTS (
                                   SELECT 1 FROM jobs_job j WHERE j.batch_id = b.id))
                        ORDER BY b.id
                        LIMIT %(batch)s
                        FOR UPDATE SKIP LOCKED
                    ))
                    RETURNING 1
                )
                SELECT count(*) FROM gone
                """,
                {"now": now, "age": _db.seconds(older_than), "batch": batch_size},
            )
            [(count,)] = cur.fetchall()
            deleted += count
            if count < batch_size:
                break
    return deleted


def _tenant(tenant: str | None, template: dict[str, object] | None) -> str:
    from jobs.core.conf import jobs_settings

    if tenant is None:
        tenant = str(template["tenant"]) if template else jobs_settings.DEFAULT_TENANT
    try:
        return validate_key(tenant, "tenant")
    except ValueError as exc:
        raise InvalidJob(str(exc)) from None
