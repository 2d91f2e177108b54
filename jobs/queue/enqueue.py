"""Enqueue: validate a whole batch, then insert-or-skip it in one statement (or COPY it).

Idempotency is the database's job. Each row is inserted with ``ON CONFLICT … DO NOTHING``
against the partial UNIQUE index over key-holding rows (``jobs_job_key_lock``); a conflict
means another row holds ``(tenant, job_id)`` and that row is returned instead. A terminal row
whose window has passed still holds its key until someone needs it: enqueue then releases it
(a conditional UPDATE, so concurrent enqueuers agree on one winner) and inserts again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from django.db import OperationalError, connections, transaction
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from jobs.core.conf import NOTIFY_CHANNEL, jobs_settings
from jobs.core.limits import MAX_ATTEMPTS_MAX, PRIORITY_MAX, PRIORITY_MIN, validate_key
from jobs.models import new_job_id, new_job_ids
from jobs.queue import _db, dependencies, flow, keys, text
from jobs.queue.flow import FAIR_AT_ENQUEUE as _FAIR
from jobs.queue.flow import FAIR_OF_ONE as _FAIR_OF_ONE
from jobs.queue.types import Enqueued, InvalidJob, NewJob

#: The furthest ahead ``delay`` may put a job; ``run_after`` is bounded by datetime itself.
DELAY_MAX = timedelta(days=100 * 365)

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
    if not isinstance(jobs, list | tuple):
        jobs = list(jobs)  # any iterable: it is read more than once
    if len(jobs) >= COPY_AT_LEAST and all(map(_copyable, jobs)):
        return _enqueue_by_copy(jobs, using or jobs_settings.DATABASE)
    defaults = _defaults()
    new_id = iter(new_job_ids(sum(getattr(job, "job_id", "") is None for job in jobs))).__next__
    rows = [_row(job, index, defaults, new_id) for index, job in enumerate(jobs)]
    if not rows:
        return []
    using = using or jobs_settings.DATABASE
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
    defaults = _defaults()
    new_id = iter(new_job_ids(len(jobs))).__next__  # every job is keyless (_copyable)
    checked: Iterable[dict[str, Any]] = (
        _row(job, index, defaults, new_id) for index, job in enumerate(jobs)
    )
    if connection.in_atomic_block or not connection.get_autocommit():
        checked = list(checked)
    with transaction.atomic(using=using, savepoint=False), _db.bound_cursor(using) as cur:
        _base, rows = _copy(cur, checked, len(jobs))
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
        id_ = _insert_one(cur, row)
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
                        cur, [row for row in waiting if done[_key(row)].created], done
                    )
                return done
        except OperationalError as exc:
            if not (owned and attempt < _DEADLOCK_RETRIES and _deadlock(exc)):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def validated_row(job: NewJob) -> dict[str, Any]:
    """The column values enqueue would insert for ``job`` (raises :class:`InvalidJob`)."""
    return _row(job, None)


def _key(row: dict[str, Any]) -> tuple[str, str]:
    return (row["tenant"], row["job_id"])


# Names, tenants and queues repeat from job to job: each is checked once (a refused one
# raises every time, as exceptions are not kept).
_name_problem = lru_cache(maxsize=1024)(text.problem)
_valid_key = lru_cache(maxsize=1024)(validate_key)


def _checked_key(value: object, what: str) -> str:
    return _valid_key(value, what) if isinstance(value, str) else validate_key(value, what)


def _defaults() -> tuple[str, str, int]:
    """The ``JOBS`` defaults a job without its own takes: tenant, queue and max_attempts
    (read once a batch, not once a job)."""
    return (
        jobs_settings.DEFAULT_TENANT,
        jobs_settings.DEFAULT_QUEUE,
        jobs_settings.DEFAULT_MAX_ATTEMPTS,
    )


def _row(
    job: NewJob,
    index: int | None,
    defaults: tuple[str, str, int] | None = None,
    new_id: Callable[[], str] = new_job_id,
) -> dict[str, Any]:
    """Validate one job and turn it into column values (raises InvalidJob). A keyless job
    takes ``new_id()``: a batch's ids are drawn together (:func:`jobs.models.new_job_ids`)."""
    default_tenant, default_queue, default_max_attempts = defaults or _defaults()
    if not isinstance(job, NewJob):
        raise InvalidJob(f"expected a NewJob, got {type(job).__name__}", index=index)
    if not isinstance(job.name, str) or not job.name or len(job.name) > 200:
        raise InvalidJob(
            f"name must be a non-empty string of at most 200 characters, got {job.name!r}",
            index=index,
        )
    if job.job_id is None:
        job_id = new_id()  # hex digits: nothing to check
    else:
        job_id = job.job_id
        if not isinstance(job_id, str) or not job_id or len(job_id) > 255:
            raise InvalidJob(
                f"job_id must be a non-empty string of at most 255 characters, got {job_id!r}",
                index=index,
            )
        bad = text.problem(job_id)
        if bad:
            raise InvalidJob(f"job_id {bad}: {job_id!r}", index=index)
    bad = _name_problem(job.name)
    if bad:
        raise InvalidJob(f"name {bad}: {job.name!r}", index=index)
    try:
        tenant = _checked_key(job.tenant or default_tenant, "tenant")
        queue = _checked_key(job.queue or default_queue, "queue")
    except ValueError as exc:
        raise InvalidJob(str(exc), index=index) from None
    if (
        isinstance(job.priority, bool)
        or not isinstance(job.priority, int)
        or not PRIORITY_MIN <= job.priority <= PRIORITY_MAX
    ):
        raise InvalidJob(
            f"priority must be a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}, "
            f"got {job.priority!r}",
            index=index,
        )
    max_attempts = default_max_attempts if job.max_attempts is None else job.max_attempts
    if (
        isinstance(max_attempts, bool)
        or not isinstance(max_attempts, int)
        or not 1 <= max_attempts <= MAX_ATTEMPTS_MAX
    ):
        raise InvalidJob(
            f"max_attempts must be a whole number from 1 to {MAX_ATTEMPTS_MAX:,}, "
            f"got {max_attempts!r}",
            index=index,
        )
    if job.run_after is not None and job.delay is not None:
        raise InvalidJob("give run_after or delay, not both", index=index)
    if job.run_after is not None and (
        not isinstance(job.run_after, datetime) or timezone.is_naive(job.run_after)
    ):
        raise InvalidJob(f"run_after must be an aware datetime, got {job.run_after!r}", index=index)
    if job.delay is not None and (
        not isinstance(job.delay, timedelta) or abs(job.delay) > DELAY_MAX
    ):
        raise InvalidJob(
            f"delay must be a timedelta of at most {DELAY_MAX.days} days, got {job.delay!r}",
            index=index,
        )
    delay = 0.0 if job.delay is None else _db.seconds(job.delay)
    # Most jobs wait for nothing: the empty tuple NewJob gives needs no checking.
    after = () if type(job.after) is tuple and not job.after else dependencies.validate(job, index)
    if job.batch_id is not None and (
        isinstance(job.batch_id, bool) or not isinstance(job.batch_id, int)
    ):
        raise InvalidJob(f"batch_id must be a batch's id, got {job.batch_id!r}", index=index)
    if not isinstance(job.payload, dict):
        raise InvalidJob(
            f"payload must be a dict (a JSON object), got {type(job.payload).__name__}", index=index
        )
    try:
        payload = text.dumps(job.payload)
    except ValueError as exc:
        raise InvalidJob(f"payload is not JSON-serializable: {exc}", index=index) from None
    return {
        "job_id": job_id,
        "keyed": job.job_id is not None,
        "name": job.name,
        "payload": payload,
        "tenant": tenant,
        "queue": queue,
        "priority": job.priority,
        "max_attempts": max_attempts,
        "run_after": job.run_after,
        "delay": delay,
        "batch_id": job.batch_id,
        "waiting_on": 0,
        "after": after,
        "on_dependency_failure": job.on_dependency_failure,
    }


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
            copied_at, _rows = _copy(cur, pending, len(pending))
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
        id_ = _insert_one(cur, rows[0])
        return [(id_, id_ is not None, base)]
    fresh = [row for row in rows if row.get("id") is None]
    if fresh or base is None:
        ids, (now,) = _draw_ids(cur, len(fresh))
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
                   COALESCE(r.run_after, %(base)s + make_interval(secs => r.delay)),
                   'queued', 0, '', '', '', TRUE, r.keyed, '', %(base)s, """
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


def _draw_ids(cur: CursorWrapper, count: int, also: str = "") -> tuple[list[int], tuple[Any, ...]]:
    """``count`` new ids, drawn in one statement, in ascending order (rows take them in the
    order they are given); and the statement's clock (and the value of the SQL ``also``)."""
    # The sequence is looked up once (a materialized CTE): left in nextval's argument, the
    # lookup ran for every id, six times the cost of drawing them (10,000 ids: 20 → 3.5 ms).
    cur.execute(
        "WITH s AS MATERIALIZED ("
        "SELECT pg_get_serial_sequence('jobs_job', 'id')::regclass AS seq) "
        "SELECT array_agg(nextval(s.seq)), "
        f"statement_timestamp(){', ' + also if also else ''} "
        "FROM s, generate_series(1, %s)",
        [max(count, 1)],
    )
    drawn, *values = cur.fetchone()
    return sorted(drawn), tuple(values)


def _copy(
    cur: CursorWrapper, rows: Iterable[dict[str, Any]], count: int
) -> tuple[datetime, list[dict[str, Any]]]:
    """Insert ``count`` keyless rows by COPY, each given its id as it goes: ``(base, rows)``.

    A keyless job's key is a random UUID, so no row holds it and nothing is skipped: what
    ``ON CONFLICT`` decides per row is not needed, and COPY writes rows faster than ``INSERT
    … SELECT`` does while the client is still sending them. What the statement computes per
    row (its due time from one clock, whether its type is tenant-ordered) is computed here
    from one read of the clock and of the tenant-ordered types, in the statement that draws
    the ids; the jobs due now are announced with one NOTIFY per name after the COPY. ``rows``
    may be a generator that validates each job as the COPY asks for it: what it raises ends
    the COPY, and the caller's transaction (or savepoint) drops what was sent.
    """
    # The clock read in UTC: COPY sends timestamptz in binary, which takes only aware times,
    # and with USE_TZ = False the statement's own clock comes back naive.
    ids, (_now, ordered, utc) = _draw_ids(
        cur, count, also=f"{flow.TENANT_ORDERED_NAMES}, statement_timestamp() AT TIME ZONE 'UTC'"
    )
    base = utc.replace(tzinfo=UTC)
    fair = frozenset(ordered)
    due: set[str] = set()
    copied: list[dict[str, Any]] = []
    due_in = {0.0: base}  # due times by delay: most jobs of a batch share one
    jsonb = _db.JSONB_VERSION

    def values() -> Iterator[tuple[Any, ...]]:
        for row, id_ in zip(rows, ids, strict=True):
            row["id"] = id_
            copied.append(row)
            run_after = row["run_after"]
            if run_after is None:
                delay = row["delay"]
                run_after = due_in.get(delay)
                if run_after is None:
                    run_after = due_in[delay] = base + timedelta(seconds=delay)
            if run_after <= base:
                due.add(row["name"])
            yield (
                id_,
                row["job_id"],
                row["name"],
                jsonb + row["payload"],
                row["tenant"],
                row["queue"],
                row["priority"],
                row["max_attempts"],
                run_after,
                row["batch_id"],
                row["waiting_on"],
                row["name"] in fair,
                base,
                *_COPY_CONSTANTS,
            )

    _db.copy_rows(cur, _COPY, _COPY_TYPES, values())
    if due and jobs_settings.NOTIFY:
        cur.execute(
            "SELECT count(pg_notify(%s, n)) FROM unnest(%s::text[]) AS n",
            [NOTIFY_CHANNEL, sorted(due)],
        )
    return base, copied


#: Batches of at least this many jobs, none with an idempotency key, are inserted by COPY
#: (:func:`_copy`): PostgreSQL CPU 11 → 7 µs a job in a batch of 10,000, and the rows are
#: written while the client sends them. A smaller batch pays less for the plainer statement.
COPY_AT_LEAST = 64

# The columns COPY writes (the rest take their defaults), as _copy's rows give them, then
# those every new job has alike.
_COPY_COLUMNS = (
    ("id", "int8"),
    ("job_id", "text"),
    ("name", "text"),
    ("payload", _db.JSONB_AS_TEXT),
    ("tenant", "text"),
    ("queue", "text"),
    ("priority", "int2"),
    ("max_attempts", "int4"),
    ("run_after", "timestamptz"),
    ("batch_id", "int8"),
    ("waiting_on", "int4"),
    ("fair", "bool"),
    ("created_at", "timestamptz"),
    ("state", "text"),
    ("attempts", "int4"),
    ("last_error", "text"),
    ("error_detail", "text"),
    ("claimed_by", "text"),
    ("key_held", "bool"),
    ("keyed", "bool"),
    ("replayed_by", "text"),
)
_COPY_CONSTANTS = ("queued", 0, "", "", "", True, False, "")
_COPY = (
    "COPY jobs_job ("
    + ", ".join(name for name, _ in _COPY_COLUMNS)
    + ") FROM STDIN (FORMAT BINARY)"
)
_COPY_TYPES = [kind for _, kind in _COPY_COLUMNS]


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


# The arguments of jobs_enqueue_job, in order, with their types.
_ONE_ARGUMENTS = {
    "job_id": "text",
    "name": "text",
    "payload": "jsonb",
    "tenant": "text",
    "queue": "text",
    "priority": "integer",
    "max_attempts": "integer",
    "run_after": "timestamptz",
    "delay": "float8",
    "keyed": "boolean",
    "batch_id": "bigint",
    "waiting_on": "integer",
    "channel": "text",
}

# The one-row insert in the function's body, ``{conflict}`` left to fill in.
_INSERT_ONE = (
    """INSERT INTO jobs_job (
            job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
            state, attempts, last_error, error_detail, claimed_by, key_held, keyed,
            replayed_by, created_at, fair, batch_id, waiting_on
        )
        VALUES (
            p_job_id, p_name, p_payload, p_tenant, p_queue, p_priority, p_max_attempts,
            v_run_after, 'queued', 0, '', '', '', TRUE, p_keyed, '', v_at,
            """
    + _FAIR_OF_ONE.format(name="p_name")
    + """,
            p_batch_id, p_waiting_on
        ){conflict}
        RETURNING id INTO v_id;"""
)

# A call of jobs_enqueue_job, whose plans each connection keeps (behind a transaction pooler
# too): parsing and planning the insert cost PostgreSQL more than running it.
_INSERT_ONE_CALL = (
    "SELECT jobs_enqueue_job("
    + ", ".join(f"%({name})s::{kind}" for name, kind in _ONE_ARGUMENTS.items())
    + ")"
)


def enqueue_function() -> str:
    """``CREATE OR REPLACE FUNCTION jobs_enqueue_job``: the one-row insert with kept plans.

    It inserts the job and returns its id, or NULL when a live row holds the job's key; once
    the job is due it sends ``p_name`` on ``p_channel`` (nothing when that is NULL). Only a
    key the caller chose can be taken: a keyless job's new key is inserted without the
    ``ON CONFLICT`` look-up, which cost the server 10 µs a job. Returning one value, not a
    table, saves PostgreSQL the set-returning call's 30 µs.

    Rendered into jobs/queue/sql/functions/, whose file the migrations install: a change to
    the insert needs a migration that installs it again.
    """
    return _ONE_FUNCTION.format(
        arguments=",\n".join(f"    p_{name} {kind}" for name, kind in _ONE_ARGUMENTS.items()),
        keyed=_INSERT_ONE.format(
            conflict="\n        ON CONFLICT (tenant, job_id) WHERE key_held DO NOTHING"
        ),
        keyless=_INSERT_ONE.format(conflict=""),
    )


# The function around the inserts. No SET clause: a function's settings are set and reset on
# every call, which cost more than a plan; its plans are the same for any arguments, so they
# are kept anyway.
_ONE_FUNCTION = """CREATE OR REPLACE FUNCTION jobs_enqueue_job(
{arguments}
) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id bigint;
    v_at timestamptz := statement_timestamp();
    v_run_after timestamptz := COALESCE(p_run_after, v_at + make_interval(secs => p_delay));
BEGIN
    IF p_keyed THEN
        {keyed}
    ELSE
        {keyless}
    END IF;
    IF v_id IS NOT NULL AND p_channel IS NOT NULL AND v_run_after <= v_at THEN
        PERFORM pg_notify(p_channel, p_name);
    END IF;
    RETURN v_id;
END
$$;
"""


def _insert_one(cur: CursorWrapper, row: dict[str, Any]) -> int | None:
    """One row (every ``enqueue()``): its id, or None when its key is held."""
    params = {key: row.get(key) for key in _ONE_ARGUMENTS}
    params["channel"] = NOTIFY_CHANNEL if jobs_settings.NOTIFY else None
    cur.execute(_INSERT_ONE_CALL, params)
    id_: int | None = cur.fetchone()[0]
    return id_
