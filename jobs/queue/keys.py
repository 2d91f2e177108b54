"""The idempotency key: which row holds ``(tenant, job_id)``, and when it lets go.

A terminal row keeps its key through its window (``SUCCESS_WINDOW`` after success,
``FAILURE_WINDOW`` after failure or cancellation). Keys are released lazily, by the first
enqueue or replay that needs one, with a conditional UPDATE so that concurrent callers agree.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.utils import CursorWrapper

from jobs.conf import jobs_settings
from jobs.queue import _db

# True for a key-holding row (alias j) whose window has passed.
WINDOW_PASSED = """(
    (j.state = 'succeeded'
     AND j.finished_at <= statement_timestamp() - make_interval(secs => %(success_window)s))
    OR (j.state IN ('failed', 'cancelled')
        AND j.finished_at <= statement_timestamp() - make_interval(secs => %(failure_window)s))
)"""


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
        WHERE j.id = ANY(%(ids)s) AND j.key_held AND {WINDOW_PASSED}
        RETURNING j.id
        """,
        {"ids": ids, **window_params()},
    )
    return {id_ for (id_,) in cur.fetchall()}


def release_for(cur: CursorWrapper, ids: list[int]) -> None:
    """Release expired keys held by *other* rows with the same keys as these rows (replay)."""
    cur.execute(
        f"""
        UPDATE jobs_job AS j SET key_held = FALSE
        FROM jobs_job t
        WHERE t.id = ANY(%(ids)s) AND j.tenant = t.tenant AND j.job_id = t.job_id
          AND j.id <> t.id AND j.key_held AND {WINDOW_PASSED}
        """,
        {"ids": ids, **window_params()},
    )
