"""Enqueue: validate a whole batch, then insert-or-skip it in one statement (or COPY it).

Idempotency is the database's job. Each row is inserted with ``ON CONFLICT … DO NOTHING``
against the partial UNIQUE index over key-holding rows (``jobs_job_key_lock``); a conflict
means another row holds ``(tenant, job_id)`` and that row is returned instead. A terminal row
whose window has passed still holds its key until someone needs it: enqueue then releases it
(a conditional UPDATE, so concurrent enqueuers agree on one winner) and inserts again.

Each job's row is built and checked in :mod:`jobs.queue.job_rows`; a single job goes in
through a database function (:mod:`jobs.queue.enqueue_one`), a large keyless batch by
``COPY`` (:mod:`jobs.queue.copying`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import OperationalError, connections, transaction
from django.db.backends.utils import CursorWrapper

from jobs.core.conf import NOTIFY_CHANNEL, jobs_settings
from jobs.models import new_job_ids
from jobs.queue import _db, copying, dependencies, enqueue_one, job_rows, keys
from jobs.queue.flow import FAIR_AT_ENQUEUE as _FAIR
from jobs.queue.job_rows import DELAY_MAX as DELAY_MAX
from jobs.queue.types import Enqueued, NewJob

# Rounds of "insert, find the key holders, release the expired ones" before giving up. Each
# round only repeats for rows whose key holder vanished or expired in the meantime.
_MAX_ROUNDS = 5

# Rows go in key order, so batches sharing keys do not deadlock, except in one case: a later
# round inserts a key that sorts before one an earlier round took, when a key holder expired
# or went away meanwhile. PostgreSQL then ends one of the transactions; try that batch again.
_DEADLOCK_RETRIES = 3


# What an insert round reports per row: the id it has (None: none drawn yet), whether the row
# went in, and the instant its due time counts from.
type Inserted = tuple[int | None, bool, datetime | None]


def _deadlock(exc: BaseException) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == "40P01"


def enqueue(job: NewJob, *, using: str | None = None) -> Enqueued:
    """Enqueue one job, or return the job already holding its ``(tenant, job_id)``."""
    return enqueue_many([job], using=using)[0]


def enqueue_many(jobs: Sequence[NewJob], *, using: str | None = None) -> list[Enqueued]:
    """Enqueue a batch atomically; results come back in input order.

    One bad job rejects the whole batch with :class:`InvalidJob`, and nothing of it is
    committed: inside a transaction the batch is checked whole before anything is sent; a
    large keyless batch outside one is checked while COPY streams it, in a transaction of its
    own that rolls back. Inside the caller's ``transaction.atomic()`` the jobs commit or roll
    back with the caller's writes; workers never see them before commit.
    ``using`` is the database alias (None: ``JOBS["DATABASE"]``), so the transaction that
    counts is the one open on that alias. The queue does not route: the caller picks the
    alias a job type lives in (:func:`jobs.catalogue.routing.route`, through the producer).
    """
    using = using or jobs_settings.DATABASE
    if not isinstance(jobs, list | tuple):
        jobs = list(jobs)  # any iterable: it is read more than once
    if len(jobs) >= COPY_AT_LEAST and all(map(_copyable, jobs)):
        return _enqueue_by_copy(jobs, using)
    defaults = job_rows.job_defaults()
    new_id = iter(new_job_ids(sum(getattr(job, "job_id", "") is None for job in jobs))).__next__
    rows = [job_rows.job_row(job, index, defaults, new_id) for index, job in enumerate(jobs)]
    if not rows:
        return []
    # The first job with a key is the one inserted; later copies in the batch return it.
    firsts: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        firsts.setdefault((row["tenant"], row["job_id"]), row)
    connection = connections[using]
    done = None
    waits = any(row["after"] for row in firsts.values())
    if (
        len(firsts) == 1
        and not waits
        and not connection.in_atomic_block
        and connection.get_autocommit()
    ):
        done = _insert_alone(next(iter(firsts.values())), using)
    if done is None:
        done = _insert_in_transaction(list(firsts.values()), using)
    results = []
    for row in rows:
        key = (row["tenant"], row["job_id"])
        result = done[key]
        if row is not firsts[key] and result.created:
            result = Enqueued(
                result.id, result.job_id, result.tenant, result.name, result.state, False, using
            )
        results.append(result)
    return results


def _copyable(job: object) -> bool:
    """Whether ``job`` can go in by COPY as it is validated: keyless, waiting for nothing."""
    return (
        isinstance(job, NewJob)
        and job.job_id is None
        and type(job.after) is tuple
        and not job.after
        and type(job.name) is str
    )


def _enqueue_by_copy(jobs: Sequence[NewJob], using: str) -> list[Enqueued]:
    """A large batch of keyless jobs: no key to look up, so no rounds, and COPY writes it.

    Outside any transaction the batch is checked while COPY streams it: the server stores
    the first rows while the client still checks the last ones, and an invalid job ends the
    COPY, so the batch's own transaction rolls back and nothing of it is ever seen. Inside the
    caller's transaction (``atomic()``, or autocommit turned off) the batch is checked whole
    before anything is sent: streaming would need a savepoint, a subtransaction of the
    caller's, to leave it usable after a refused job.
    """
    connection = connections[using]
    defaults = job_rows.job_defaults()
    new_id = iter(new_job_ids(len(jobs))).__next__  # every job is keyless (_copyable)
    checked: Iterable[dict[str, Any]] = (
        job_rows.job_row(job, index, defaults, new_id) for index, job in enumerate(jobs)
    )
    if connection.in_atomic_block or not connection.get_autocommit():
        checked = list(checked)
    with transaction.atomic(using=using, savepoint=False), _db.bound_cursor(using) as cur:
        _base, rows = copying.copy_jobs(cur, checked, len(jobs))
    return [
        Enqueued(row["id"], row["job_id"], row["tenant"], row["name"], "queued", True, using)
        for row in rows
    ]


def _insert_alone(row: dict[str, Any], using: str) -> dict[tuple[str, str], Enqueued] | None:
    """One job outside any transaction: one round trip, without BEGIN and COMMIT.

    Its insert is one statement, atomic by itself. None when the job's key is taken: only
    then are the rounds of :func:`_insert_or_find` needed, and the skipped insert wrote
    nothing.
    """
    with _db.bound_cursor(using) as cur:
        id_ = enqueue_one.insert_one(cur, row)
    if id_ is None:
        return None
    key = (row["tenant"], row["job_id"])
    return {key: Enqueued(id_, row["job_id"], row["tenant"], row["name"], "queued", True, using)}


def _insert_in_transaction(
    rows: list[dict[str, Any]], using: str
) -> dict[tuple[str, str], Enqueued]:
    # Inside the caller's transaction a deadlock is the caller's to retry: it aborted their
    # writes too. Owning the transaction, a deadlock costs nothing to retry.
    owned = not connections[using].in_atomic_block
    waiting = [row for row in rows if row["after"]]
    # What jobs wait for is checked against the table, so it can still be refused in here: a
    # savepoint keeps the caller's transaction usable then.
    savepoint = bool(waiting)
    for attempt in range(1, _DEADLOCK_RETRIES + 1):
        try:
            with (
                transaction.atomic(using=using, savepoint=savepoint),
                _db.bound_cursor(using) as cur,
            ):
                if waiting:
                    dependencies.prepare(cur, waiting)
                done = _insert_or_find(cur, rows)
                if waiting:
                    dependencies.link(
                        cur, [row for row in waiting if done[job_rows.row_key(row)].created], done
                    )
                return done
        except OperationalError as exc:
            if not (owned and attempt < _DEADLOCK_RETRIES and _deadlock(exc)):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def _insert_or_find(
    cur: CursorWrapper, rows: list[dict[str, Any]]
) -> dict[tuple[str, str], Enqueued]:
    done: dict[tuple[str, str], Enqueued] = {}
    using = cur.db.alias  # each result names the database it is in
    pending = rows
    # Later rounds reuse the first round's clock, so a row inserted late is as due as the rest.
    base: datetime | None = None
    for _round in range(_MAX_ROUNDS):
        if (
            base is None
            and len(pending) >= COPY_AT_LEAST
            and not any(row["keyed"] for row in pending)
        ):
            copied_at, _rows = copying.copy_jobs(cur, pending, len(pending))
            inserts: list[Inserted] = [(row["id"], True, copied_at) for row in pending]
        else:
            inserts = _insert(cur, pending, base)
        base = inserts[0][2]
        for row, (id_, inserted, _at) in zip(pending, inserts, strict=True):
            # A skipped row keeps the id it was given, so a later round inserts it in its place.
            row["id"] = id_
            if inserted and id_ is not None:
                key = (row["tenant"], row["job_id"])
                done[key] = Enqueued(
                    id_, row["job_id"], row["tenant"], row["name"], "queued", True, using
                )
        skipped = [row for row in pending if (row["tenant"], row["job_id"]) not in done]
        if not skipped:
            return done
        holders = keys.holders(cur, [(row["tenant"], row["job_id"]) for row in skipped])
        keys.release(cur, [h["id"] for h in holders.values() if h["expired"]])
        pending = []
        for row in skipped:
            key = (row["tenant"], row["job_id"])
            holder = holders.get(key)
            if holder is None or holder["expired"]:
                # The key is free now: insert again. When a concurrent enqueuer released the
                # expired holder first (ours released nothing), the next round's insert meets
                # that enqueuer's new row, which is the live one to report.
                pending.append(row)
            else:
                done[key] = Enqueued(
                    holder["id"],
                    row["job_id"],
                    row["tenant"],
                    holder["name"],
                    holder["state"],
                    False,
                    using,
                )
        if not pending:
            return done
    raise RuntimeError(
        f"enqueue could not settle {len(pending)} job keys after {_MAX_ROUNDS} rounds"
    )


def _insert(
    cur: CursorWrapper, rows: list[dict[str, Any]], base: datetime | None
) -> list[Inserted]:
    """Insert what no live row holds the key of; ``(id, inserted, base)`` per row, in order.

    Ids are drawn first, in one statement, and handed out in the order the rows are given, so
    a batch is claimed in that order (the claim breaks priority and due-time ties by id); a
    skipped row keeps its id for a later round. Rows are inserted in key order, so concurrent
    batches that share keys wait on each other in one order instead of deadlocking. ``base``
    is the instant due times and ``created_at`` count from: the first round's clock.
    """
    if len(rows) == 1 and rows[0].get("id") is None:
        # A single row (a row of a batch keeps the id it drew) is never inserted beside
        # others, so each round may read its own clock.
        id_ = enqueue_one.insert_one(cur, rows[0])
        return [(id_, id_ is not None, base)]
    fresh = [row for row in rows if row.get("id") is None]
    if fresh or base is None:
        ids, (now,) = copying.draw_ids(cur, len(fresh))
        for row, id_ in zip(fresh, ids, strict=False):
            row["id"] = id_
        base = base or now
    ordered = sorted(rows, key=lambda row: (row["tenant"], row["job_id"]))
    params: dict[str, Any] = {key: [row[key] for row in ordered] for key in _COLUMNS}
    params["base"] = base
    notify = (
        f""",
        notified AS (
            SELECT count(pg_notify('{NOTIFY_CHANNEL}', due.name)) AS sent
            FROM (
                SELECT DISTINCT name FROM inserted WHERE run_after <= statement_timestamp()
            ) AS due
        )
        SELECT inserted.id FROM inserted, notified"""
        if jobs_settings.NOTIFY
        else """
        SELECT id FROM inserted"""
    )
    cur.execute(
        """
        WITH inserted AS (
            INSERT INTO jobs_job (
                id, job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
                replayed_by, created_at, fair, batch_id, waiting_on
            )
            SELECT r.id, r.job_id, r.name, r.payload, r.tenant, r.queue, r.priority,
                   r.max_attempts,
                   CASE WHEN r.waiting_on = 0  -- a job that waits for others is not due yet
                        THEN COALESCE(r.run_after, %(base)s + make_interval(secs => r.delay))
                   END,
                   'queued', 0, '', '', '', r.keyed, r.keyed, '', %(base)s, """
        + _FAIR.format(name="r.name")
        + """, r.batch_id, r.waiting_on
            FROM unnest(
                %(id)b::bigint[], %(job_id)b::text[], %(name)b::text[], %(payload)b::jsonb[],
                %(tenant)b::text[], %(queue)b::text[], %(priority)b::smallint[],
                %(max_attempts)b::int[], %(run_after)b::timestamptz[], %(delay)b::float8[],
                %(keyed)b::bool[], %(batch_id)b::bigint[], %(waiting_on)b::int[]
            ) AS r(id, job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                   delay, keyed, batch_id, waiting_on)
            ON CONFLICT (tenant, job_id) WHERE key_held DO NOTHING
            RETURNING id, name, run_after
        )"""
        + notify,
        params,
    )
    inserted = {id_ for (id_,) in cur.fetchall()}
    return [(row["id"], row["id"] in inserted, base) for row in rows]


#: Batches of at least this many jobs, none with an idempotency key, are inserted by COPY
#: (:func:`jobs.queue.copying.copy_jobs`): PostgreSQL CPU 11 → 7 µs a job in a batch of
#: 10,000, and the rows are written while the client sends them. A smaller batch pays less
#: for the plainer statement.
COPY_AT_LEAST = 64


_COLUMNS = (
    "id",
    "job_id",
    "name",
    "payload",
    "tenant",
    "queue",
    "priority",
    "max_attempts",
    "run_after",
    "delay",
    "keyed",
    "batch_id",
    "waiting_on",
)
