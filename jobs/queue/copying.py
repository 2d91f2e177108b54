"""A batch of keyless jobs written by ``COPY``, and the ids every batch draws in one statement.

A keyless job's key is a random UUID, so no row holds it and nothing is skipped: ``COPY``
writes such a batch faster than ``INSERT … SELECT`` does, while the client still sends it
(:data:`jobs.queue.enqueue.COPY_AT_LEAST` says from what size).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.backends.utils import CursorWrapper

from jobs.core.conf import NOTIFY_CHANNEL, jobs_settings
from jobs.queue import _db, flow


def draw_ids(cur: CursorWrapper, count: int, also: str = "") -> tuple[list[int], tuple[Any, ...]]:
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


def copy_jobs(
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
    ids, (_now, ordered, utc) = draw_ids(
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
            run_after, delay = row["run_after"], row["delay"]
            if run_after is None and delay is not None:  # neither: it waits for others
                run_after = due_in.get(delay)
                if run_after is None:
                    run_after = due_in[delay] = base + timedelta(seconds=delay)
            if run_after is not None and run_after <= base:
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


# The columns COPY writes (the rest take their defaults), as copy_jobs gives them, then
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
# Every copied job is keyless: it holds no key (jobs.queue.keys).
_COPY_CONSTANTS = ("queued", 0, "", "", "", False, False, "")
_COPY = (
    "COPY jobs_job ("
    + ", ".join(name for name, _ in _COPY_COLUMNS)
    + ") FROM STDIN (FORMAT BINARY)"
)
_COPY_TYPES = [kind for _, kind in _COPY_COLUMNS]
