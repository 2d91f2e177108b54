"""Jobs that wait for other jobs (``after=`` at enqueue), and their release.

A waiting job is an ordinary queued row with no ``run_after`` and ``waiting_on`` counting the
jobs it waits for that have not succeeded. Every claim asks for rows due by now, which a NULL
never is, and the claim indexes keep NULLs after every time, so a million waiting jobs cost
the claim what a million jobs scheduled far ahead do: nothing. One edge row per (waiting job,
job it waits for) is in ``jobs_dependency``; ``settled`` says the edge's upstream outcome has
been applied.

When a job others wait for (``depended_on``) ends, the settle trigger records a settlement
(``jobs_settlement``): one insert, whatever the fan-out, so the statement that ends the job
costs the same for one waiting job or a million. :func:`release` applies settlements after
it, in bounded steps: each waiting job has one fewer to wait for on success (due now when
none is left), or ends as its edge says (``on_failure``) when the job it waited for failed
or was cancelled. A job ended that way fires the trigger in turn, so a chain settles down to
its end, a step at a time. The worker runs :func:`release` as soon as its pass ends such a
job, and every worker and the scheduler also look for pending settlements every second.

Enqueue writes nothing on the jobs it waits for: a producer whose transaction stays open
must not hold a running job's row, or the lease renewal (which skips locked rows) could not
extend it. It reads their states, and as its transaction commits a deferred check
(``jobs_dependency_check``) marks each unfinished one ``depended_on`` under a row lock held
only until that commit, and applies the outcome of any that ended since it was read: that
job's release ran without seeing the new edges, which were not committed yet. An edge is
settled once, by whichever of the two comes first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, transaction
from django.db.backends.utils import CursorWrapper

from jobs.models import DependencyFailure
from jobs.queue import _db, keys, text
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
    """Resolve what each row waits for; set its ``waiting_on`` and ``run_after``.

    Must run in the enqueue's transaction, before the rows are inserted. Each row gets
    ``upstream``: the row ids it waits for, in order. Reads the states of those jobs and
    locks nothing (see the module docstring).
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
                    f"(name a job enqueued without a job_id, or one that let its key go, by "
                    f"its id)"
                )
        row["upstream"] = list(dict.fromkeys(upstream))
    states, tenants = _states(cur, {id_ for row in rows for id_ in row["upstream"]})
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
        # No due time at all while it waits: every insert path writes NULL for that.
        row["run_after"], row["delay"] = (None, None) if row["waiting_on"] else given
        row["upstream_states"] = states


def link(
    cur: CursorWrapper, rows: list[dict[str, Any]], done: Mapping[tuple[str, str], Enqueued]
) -> None:
    """Insert the edges of the rows just inserted; end those waiting on a failed job; check
    the others as the transaction commits."""
    if not rows:
        return
    edges = [
        (done[(row["tenant"], row["job_id"])].id, up, row["on_dependency_failure"])
        for row in rows
        for up in row["upstream"]
    ]
    states = {up: row["upstream_states"][up] for row in rows for up in row["upstream"]}
    _insert_edges(cur, edges, states)


def reckon(cur: CursorWrapper, ids: Iterable[int]) -> None:
    """Count again what replayed jobs wait for, from the state of each job they wait for now.

    A replayed job that waited for others waits again for those that have not succeeded
    (and ends at once, as its edge says, if one of them has failed or was cancelled).
    """
    cur.execute(
        "DELETE FROM jobs_dependency WHERE job = ANY(%s) RETURNING job, upstream, on_failure",
        [sorted(set(ids))],
    )
    edges = sorted(cur.fetchall())
    if not edges:
        return
    states, _tenants = _states(cur, {up for _job, up, _ in edges})
    # Gone from both tables: it cannot succeed now.
    states = {up: states.get(up, "cancelled") for _job, up, _ in edges}
    waiting: dict[int, int] = {}
    for job, up, _ in edges:
        waiting[job] = waiting.get(job, 0) + (states[up] != "succeeded")
    cur.execute(
        """
        UPDATE jobs_job j
        SET waiting_on = w.n,
            run_after = CASE WHEN w.n > 0 THEN NULL ELSE j.run_after END
        FROM unnest(%s::bigint[], %s::int[]) AS w(id, n)
        WHERE j.id = w.id AND j.state || '' = 'queued'
        """,
        [list(waiting), list(waiting.values())],
    )
    _insert_edges(cur, edges, states)


#: Waiting jobs one :func:`release` step applies a settlement to, in one transaction.
RELEASE_STEP = 5000


@dataclass(frozen=True)
class Released:
    """What one :func:`release` step did: the settlement it worked on (None: none pending
    that no other session holds), the waiting jobs it settled, and whether it finished it."""

    upstream: int | None = None
    state: str = ""
    settled: int = 0
    finished: bool = False
    settlement: int | None = None


def release(
    *, step: int = RELEASE_STEP, skip: Iterable[int] = (), using: str = DEFAULT_DB_ALIAS
) -> Released:
    """Apply up to ``step`` waiting jobs of a pending settlement, in one transaction.

    Settlements of one job are applied in the order they were made (a job that failed, was
    replayed and succeeded releases as failed first); sessions running this at once take
    different jobs' settlements (rows locked by another are skipped), and settlements whose
    id is in ``skip`` are left for later. Raises :class:`ReleaseFailed` (a lock or statement
    timeout: try again later, nothing of that step was applied).
    """
    settlement = None
    try:
        with transaction.atomic(using=using), _db.cursor(using) as cur:
            cur.execute(_PICK, {"skip": sorted(set(skip))})
            row = cur.fetchone()
            if row is None:
                return Released()
            settlement, upstream, state, cutoff = row
            cur.execute(_APPLY, {"up": upstream, "state": state, "cutoff": cutoff, "step": step})
            [(taken, settled)] = cur.fetchall()
            finished = taken < step
            if finished:
                cur.execute("DELETE FROM jobs_settlement WHERE id = %s", [settlement])
    except DatabaseError as exc:
        if settlement is None:
            raise
        raise ReleaseFailed(settlement, exc) from exc
    return Released(upstream, state, settled, finished, settlement)


class ReleaseFailed(DatabaseError):
    """A release step failed on one settlement (a lock another session holds, say)."""

    def __init__(self, settlement: int, cause: BaseException) -> None:
        super().__init__(f"releasing settlement {settlement}: {cause}")
        self.settlement = settlement


def replayed(cur: CursorWrapper, ids: Iterable[int]) -> None:
    """Jobs were replayed: a release pending from how they ended applies to the jobs that
    waited for them until now, not to those that will wait for their next run."""
    cur.execute(
        "UPDATE jobs_settlement SET cutoff = statement_timestamp() "
        "WHERE upstream = ANY(%s) AND cutoff IS NULL",
        [sorted(set(ids))],
    )


def release_pending(
    *, budget: float = 0.5, step: int = RELEASE_STEP, using: str = DEFAULT_DB_ALIAS
) -> int:
    """Run :func:`release` steps until none is pending or ``budget`` seconds have passed;
    the number of waiting jobs settled. A service's ``run_once`` (the worker and the
    scheduler call it); raises DatabaseError, having kept the steps already committed.
    """
    with _db.cursor(using) as cur:  # an empty table's answer, without a transaction
        cur.execute("SELECT EXISTS (SELECT 1 FROM jobs_settlement)")
        [(any_pending,)] = cur.fetchall()
    if not any_pending:
        return 0
    settled = 0
    deadline = time.monotonic() + budget
    failed: list[int] = []
    while True:
        try:
            done = release(step=step, skip=failed, using=using)
        except ReleaseFailed as exc:
            # That settlement waits for a lock: the others go on, it is tried next time.
            failed.append(exc.settlement)
            if time.monotonic() >= deadline:
                raise
            continue
        settled += done.settled
        if done.upstream is None or time.monotonic() >= deadline:
            if failed:
                raise ReleaseFailed(failed[0], DatabaseError("a lock held it up"))
            return settled


def pending_settlements(*, using: str = DEFAULT_DB_ALIAS) -> int:
    """How many settlements wait to be applied (for gauges and tests)."""
    with _db.cursor(using) as cur:
        cur.execute("SELECT count(*) FROM jobs_settlement")
        [(count,)] = cur.fetchall()
    return int(count)


# A settlement no session holds whose job has none older (of those, the lowest job's: a job
# waiting for two that ended together ends by the lower one's edge).
_PICK = """
SELECT s.id, s.upstream, s.state, s.cutoff FROM jobs_settlement s
WHERE s.id <> ALL(%(skip)s::bigint[])
  AND NOT EXISTS (
    SELECT 1 FROM jobs_settlement o WHERE o.upstream = s.upstream AND o.id < s.id
  )
ORDER BY s.upstream, s.id LIMIT 1
FOR UPDATE SKIP LOCKED
"""
# The next edges it has not applied (made before its job was replayed, if it was), applied
# (jobs_dependents_release, in jobs/queue/sql/functions/): how many were taken, and how many
# waiting jobs that settled.
_APPLY = """
WITH next AS (
    SELECT ARRAY(
        SELECT d.job FROM jobs_dependency d
        WHERE d.upstream = %(up)s AND NOT d.settled
          AND (%(cutoff)s::timestamptz IS NULL OR d.created_at < %(cutoff)s::timestamptz)
        ORDER BY d.job LIMIT %(step)s
    ) AS jobs
)
SELECT cardinality(jobs), jobs_dependents_release(%(up)s, %(state)s, jobs) FROM next
"""

_TERMINAL = ("succeeded", "failed", "cancelled")


def _insert_edges(
    cur: CursorWrapper, edges: list[tuple[int, int, str]], states: Mapping[int, str]
) -> None:
    """Insert edges (waiting job, job waited for, on_failure), given the states read of the
    jobs waited for.

    An edge to a job that succeeded is settled already (the count left it out). Jobs waiting
    for one that failed or was cancelled end now, as their edge says. Each job not finished
    when read is checked again as the transaction commits (``jobs_dependency_check``).
    """
    cur.execute(
        "INSERT INTO jobs_dependency (job, upstream, on_failure, settled, created_at) "
        "SELECT *, statement_timestamp() "
        "FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::boolean[])",
        [
            [job for job, _, _ in edges],
            [up for _, up, _ in edges],
            [policy for _, _, policy in edges],
            [states[up] == "succeeded" for _, up, _ in edges],
        ],
    )
    ended = [(job, up) for job, up, _ in edges if states[up] in _FAILED]
    if ended:
        cur.execute(
            "SELECT jobs_dependents_release(e.up, %s::jsonb ->> e.up::text, e.jobs) "
            "FROM (SELECT up, array_agg(job ORDER BY job) AS jobs "
            "      FROM unnest(%s::bigint[], %s::bigint[]) AS e(job, up) GROUP BY up) e "
            "ORDER BY e.up",
            [
                text.dumps({str(up): states[up] for _, up in ended}),
                [job for job, _ in ended],
                [up for _, up in ended],
            ],
        )
    unfinished = [(job, up) for job, up, _ in edges if states[up] not in _TERMINAL]
    if unfinished:
        # In upstream order: concurrent commits lock the jobs they wait for in one order.
        cur.execute(
            "INSERT INTO jobs_dependency_check (upstream, jobs) "
            "SELECT up, array_agg(job ORDER BY job) "
            "FROM unnest(%s::bigint[], %s::bigint[]) AS e(job, up) GROUP BY up ORDER BY up",
            [[job for job, _ in unfinished], [up for _, up in unfinished]],
        )


def _states(cur: CursorWrapper, ids: Iterable[int]) -> tuple[dict[int, str], dict[int, str]]:
    """Each job's state and tenant, from the jobs table or its history (read, not locked).

    Ids found in neither table are left out.
    """
    wanted = sorted(set(ids))
    if not wanted:
        return {}, {}
    cur.execute("SELECT id, state, tenant FROM jobs_job WHERE id = ANY(%s)", [wanted])
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
