"""One job inserted by a database function, ``jobs_enqueue_job``, whose plans each connection
keeps (behind a transaction pooler too): parsing and planning the insert cost PostgreSQL more
than running it. Every ``enqueue()`` of a single job outside a transaction takes this path
(:func:`jobs.queue.enqueue.enqueue_many`), and so does a lone row of a later round.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.utils import CursorWrapper

from jobs.core.conf import NOTIFY_CHANNEL, jobs_settings
from jobs.queue.flow import FAIR_OF_ONE as _FAIR_OF_ONE

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
            v_run_after, 'queued', 0, '', '', '', p_keyed, p_keyed, '', v_at,
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


def insert_one(cur: CursorWrapper, row: dict[str, Any]) -> int | None:
    """One row (every ``enqueue()``): its id, or None when its key is held."""
    params = {key: row.get(key) for key in _ONE_ARGUMENTS}
    params["channel"] = NOTIFY_CHANNEL if jobs_settings.NOTIFY else None
    cur.execute(_INSERT_ONE_CALL, params)
    id_: int | None = cur.fetchone()[0]
    return id_
