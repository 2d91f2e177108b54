"""The idempotency key: which row holds ``(tenant, job_id)``, and when it lets go.

A terminal row keeps its key through its window (``SUCCESS_WINDOW`` after success,
``FAILURE_WINDOW`` after failure or cancellation). Keys are released lazily, by the first
enqueue or replay that needs one, with a conditional UPDATE so that concurrent callers agree.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.utils import CursorWrapper

from jobs.core.conf import jobs_settings
from jobs.queue import _db

# True for a key-holding row (alias j) whose window has passed.
WINDOW_PASSED = """(
    (j.state = 'succeeded'
     AND j.finished_at <= statement_timestamp() - make_interval(secs => %(success_window)s))
    OR (j.state IN ('failed', 'cancelled')
        AND j.finished_at <= statement_timestamp() - make_interval(secs => %(failure_window)s))
)"""


# The same for rows found by id. A lookup by id that also tests ``key_held`` or ``state`` as a
# partial index's predicate does can be planned on that index, read whole, when the statistics
# were taken while it held few rows: ``key_held IS TRUE`` and ``state || ''`` test the same and
# match no predicate, so the rows are read by key.
_WINDOW_PASSED_BY_ID = "j.key_held IS TRUE AND " + WINDOW_PASSED.replace(
    "j.state", "(j.state || '')"
)


def window_params() -> dict[str, float]:
    return {
        "success_window": _db.seconds(jobs_settings.SUCCESS_WINDOW),
        "failure_window": _db.seconds(jobs_settings.FAILURE_WINDOW),
    }


def holders(
    cur: CursorWrapper, keys: list[tuple[str, str]]
) -> dict[tuple[str, str], dict[str, Any]]:
    """The rows holding these keys, and whether each one's window has passed."""
    cur.execute(
        f"""
        SELECT j.id, j.tenant, j.job_id, j.name, j.state, {WINDOW_PASSED} AS expired
        FROM jobs_job j
        JOIN unnest(%(tenants)s::text[], %(job_ids)s::text[]) AS k(tenant, job_id)
          ON j.tenant = k.tenant AND j.job_id = k.job_id
        WHERE j.key_held
        """,
        {
            "tenants": [tenant for tenant, _ in keys],
            "job_ids": [job_id for _, job_id in keys],
            **window_params(),
        },
    )
    return {
        (tenant, job_id): {"id": id_, "name": name, "state": state, "expired": expired}
        for id_, tenant, job_id, name, state, expired in cur.fetchall()
    }


def release(cur: CursorWrapper, ids: list[int]) -> set[int]:
    """Let these rows give up their keys if their window has passed; returns those released."""
    if not ids:
        return set()
    cur.execute(
        f"""
        UPDATE jobs_job AS j SET key_held = FALSE
        WHERE j.id = ANY(%(ids)s) AND {_WINDOW_PASSED_BY_ID}
        RETURNING j.id
        """,
        {"ids": ids, **window_params()},
    )
    return {id_ for (id_,) in cur.fetchall()}


def release_for(cur: CursorWrapper, ids: list[int]) -> None:
    """Release expired keys held by *other* rows with the same keys as these rows (replay).

    Each row's key is looked up in the key lock, for each row in turn (``LATERAL`` with a
    ``LIMIT``, which the planner cannot fold into a join that reads the key lock whole); a
    key has one holder at most.
    """
    cur.execute(
        f"""
        UPDATE jobs_job AS j SET key_held = FALSE
        FROM jobs_job t
        CROSS JOIN LATERAL (
            SELECT o.id FROM jobs_job o
            WHERE o.tenant = t.tenant AND o.job_id = t.job_id AND o.key_held AND o.id <> t.id
            LIMIT 1
        ) holder
        WHERE t.id = ANY(%(ids)s) AND j.id = holder.id AND {_WINDOW_PASSED_BY_ID}
        """,
        {"ids": ids, **window_params()},
    )
