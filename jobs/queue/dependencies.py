"""Jobs that wait for other jobs (``after=`` at enqueue).

A waiting job is an ordinary queued row with ``run_after`` at :data:`WAITING_UNTIL` and
``waiting_on`` counting the jobs it waits for that have not succeeded. No claim's range scan
reaches a row due in the year 9000, so a million waiting jobs cost the claim what a million
jobs scheduled far ahead do: nothing. One edge row per (waiting job, job it waits for) is in
``jobs_dependency``.

The jobs waited for are marked ``depended_on``; when such a job's state changes, the settle
trigger (migration 0010, ``jobs_dependents_settle``) moves each waiting job in the same
transaction: one fewer to wait for on success, due now when none is left; cancelled or failed
(its edge's ``on_failure``) when the job it waits for failed or was cancelled. That change of
the waiting job fires the trigger in turn, so a chain settles to its end at once.

Enqueue marks the jobs waited for under their row locks before the waiting job's row goes in,
so a job finishing at that moment either is seen finished here or finds the new edge when its
own trigger runs: no waiting job misses the change it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db.backends.utils import CursorWrapper

from jobs.models import WAITING_UNTIL, DependencyFailure
from jobs.queue import keys
from jobs.queue.types import Enqueued, InvalidJob, NewJob

#: The most jobs one job may wait for.
AFTER_MAX = 1000

_FAILED = ("failed", "cancelled")


def validate(job: NewJob, index: int | None) -> tuple[int | str, ...]:
    """The distinct jobs ``job`` waits for, in order (raises :class:`InvalidJob`)."""
    after = job.after
    if isinstance(after, str | bytes | int) or not isinstance(after, tuple | list):
        raise InvalidJob(
            f"after must be a list of job row ids or job_ids, got {type(after).__name__}",
            index=index,
        )
    if not after:
        return ()
    if len(after) > AFTER_MAX:
        raise InvalidJob(
            f"a job may wait for at most {AFTER_MAX:,} jobs, got {len(after):,}", index=index
        )
    for item in after:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise InvalidJob(
                f"after takes job row ids (int) or job_ids (str), got {item!r}", index=index
            )
        if isinstance(item, int) and item < 1:
            raise InvalidJob(f"after: {item} is not a job row id", index=index)
        if isinstance(item, str) and not 1 <= len(item) <= 255:
            raise InvalidJob(f"after: job_id {item!r} must be 1-255 characters", index=index)
    if job.run_after is not None or job.delay is not None:
        raise InvalidJob(
            "a job that waits for others runs when they have succeeded: "
            "give after, or run_after/delay, not both",
            index=index,
        )
    if job.on_dependency_failure not in DependencyFailure.values:
        raise InvalidJob(
            f"on_dependency_failure must be one of {', '.join(DependencyFailure.values)}, "
            f"got {job.on_dependency_failure!r}",
            index=index,
        )
    return tuple(dict.fromkeys(after))


def prepare(cur: CursorWrapper, rows: list[dict[str, Any]]) -> None:
    """Resolve and lock what each row waits for; set its ``waiting_on`` and ``run_after``.

    Must run in the enqueue's transaction, before the rows are inserted. Each row gets
    ``upstream``: the row ids it waits for, in order.
    """
    named = {
        (row["tenant"], item) for row in rows for item in row["after"] if isinstance(item, str)
    }
    ids_of = _resolve(cur, named)
    for row in rows:
        upstream = []
        for item in row["after"]:
            if isinstance(item, int):
                upstream.append(item)
            elif (row["tenant"], item) in ids_of:
                upstream.append(ids_of[(row["tenant"], item)])
            else:
                raise InvalidJob(
                    f"after: no job holds job_id {item!r} in tenant {row['tenant']} "
                    f"(name a job that let its key go by its row id)"
                )
        row["upstream"] = list(dict.fromkeys(upstream))
    states, tenants = _lock(cur, {id_ for row in rows for id_ in row["upstream"]})
    for row in rows:
        missing = [id_ for id_ in row["upstream"] if id_ not in states]
        if missing:
            raise InvalidJob(f"after: no job has row id {missing[0]}")
        foreign = [id_ for id_ in row["upstream"] if tenants[id_] != row["tenant"]]
        if foreign:  # as a job_id names a job of the row's own tenant only
            raise InvalidJob(
                f"after: job {foreign[0]} belongs to another tenant than {row['tenant']}"
            )
        row["waiting_on"] = sum(states[id_] != "succeeded" for id_ in row["upstream"])
        # As the caller gave them: a retried enqueue (after a deadlock) prepares the same rows
        # again, and may find nothing left to wait for this time.
        given = row.setdefault("given_when", (row["run_after"], row["delay"]))
        row["run_after"], row["delay"] = (WAITING_UNTIL, 0.0) if row["waiting_on"] else given
        row["upstream_states"] = states


def link(
    cur: CursorWrapper, rows: list[dict[str, Any]], done: Mapping[tuple[str, str], Enqueued]
) -> None:
    """Insert the edges of the rows just inserted, then end those waiting on a failed job."""
    if not rows:
        return
    jobs, upstreams, policies = [], [], []
    failed: dict[int, str] = {}
    for row in rows:
        for up in row["upstream"]:
            jobs.append(done[(row["tenant"], row["job_id"])].id)
            upstreams.append(up)
            policies.append(row["on_dependency_failure"])
            state = row["upstream_states"][up]
            if state in _FAILED:
                failed[up] = state
    cur.execute(
        "INSERT INTO jobs_dependency (job, upstream, on_failure) "
        "SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::text[])",
        [jobs, upstreams, policies],
    )
    _settle_failed(cur, failed)


def reckon(cur: CursorWrapper, ids: Iterable[int]) -> None:
    """Count again what replayed jobs wait for, from the state of each job they wait for now.

    A replayed job that waited for others waits again for those that have not succeeded
    (and ends at once, as its edge says, if one of them has failed or was cancelled).
    """
    cur.execute(
        "SELECT job, upstream FROM jobs_dependency WHERE job = ANY(%s) ORDER BY job, upstream",
        [sorted(set(ids))],
    )
    edges = cur.fetchall()
    if not edges:
        return
    states = lock(cur, {up for _job, up in edges})
    waiting: dict[int, int] = {}
    failed: dict[int, str] = {}
    for job, up in edges:
        state = states.get(up, "cancelled")  # gone from both tables: it cannot succeed now
        waiting[job] = waiting.get(job, 0) + (state != "succeeded")
        if state in _FAILED:
            failed[up] = state
    cur.execute(
        """
        UPDATE jobs_job j
        SET waiting_on = w.n,
            run_after = CASE WHEN w.n > 0 THEN %s ELSE j.run_after END
        FROM unnest(%s::bigint[], %s::int[]) AS w(id, n)
        WHERE j.id = w.id AND j.state || '' = 'queued'
        """,
        [WAITING_UNTIL, list(waiting), list(waiting.values())],
    )
    _settle_failed(cur, failed)


def lock(cur: CursorWrapper, ids: Iterable[int]) -> dict[int, str]:
    """Mark ``ids`` as waited for, under their row locks (in id order); their states.

    A job already in the history table has finished for good and needs no mark. Ids found
    in neither table are left out of the result.
    """
    return _lock(cur, ids)[0]


def _lock(cur: CursorWrapper, ids: Iterable[int]) -> tuple[dict[int, str], dict[int, str]]:
    """:func:`lock`, with each job's tenant too."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}, {}
    cur.execute(
        """
        WITH locked AS (
            SELECT id FROM jobs_job WHERE id = ANY(%(ids)s) ORDER BY id FOR NO KEY UPDATE
        )
        UPDATE jobs_job j SET depended_on = TRUE
        FROM locked WHERE j.id = locked.id
        RETURNING j.id, j.state, j.tenant
        """,
        {"ids": wanted},
    )
    found = cur.fetchall()
    rest = [id_ for id_ in wanted if id_ not in {id_ for id_, _, _ in found}]
    if rest:
        cur.execute("SELECT id, state, tenant FROM jobs_jobhistory WHERE id = ANY(%s)", [rest])
        found.extend(cur.fetchall())
    return {id_: state for id_, state, _ in found}, {id_: tenant for id_, _, tenant in found}


def _resolve(cur: CursorWrapper, named: set[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The row holding each (tenant, job_id): active, or finished within its window.

    A job that has let its key go (cancelled before it ran, or its window passed) is named
    by its row id instead: a holder whose window has passed is about to let it go to the
    next job enqueued under it, and waiting for its old outcome would be waiting for the
    wrong job.
    """
    if not named:
        return {}
    tenants, job_ids = zip(*sorted(named), strict=True)
    cur.execute(
        f"""
        SELECT j.tenant, j.job_id, j.id
        FROM unnest(%(tenants)s::text[], %(job_ids)s::text[]) AS k(tenant, job_id)
        JOIN jobs_job j ON j.tenant = k.tenant AND j.job_id = k.job_id AND j.key_held
        WHERE NOT {keys.WINDOW_PASSED}
        """,
        {"tenants": list(tenants), "job_ids": list(job_ids), **keys.window_params()},
    )
    return {(tenant, job_id): id_ for tenant, job_id, id_ in cur.fetchall()}


def _settle_failed(cur: CursorWrapper, failed: Mapping[int, str]) -> None:
    if failed:
        cur.execute(
            "SELECT jobs_dependents_settle(f.id, f.state) "
            "FROM unnest(%s::bigint[], %s::text[]) AS f(id, state)",
            [list(failed), list(failed.values())],
        )
