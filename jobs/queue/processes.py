"""The processes table: live ``runworker`` and ``runscheduler`` processes.

A process's row is refreshed by a statement it makes anyway (:data:`BEAT_CTE` rides in the
worker's lease renewal), so a registry of live processes costs no extra commit on a busy
worker.
"""

from __future__ import annotations

from typing import Any

from jobs.queue.types import ProcessBeat

# A CTE for statements that refresh the caller's process row along with their own work.
BEAT_CTE = """
beat AS (
    UPDATE jobs_process
    SET last_seen_at = statement_timestamp(),
        expires_at = statement_timestamp() + make_interval(secs => %(beat_expires_in)s),
        held = %(beat_held)s, draining = %(beat_draining)s, leader = %(beat_leader)s
    WHERE identity = %(beat_identity)s
    RETURNING 1
)"""


def beat_params(beat: ProcessBeat | None) -> dict[str, Any]:
    """The parameters of :data:`BEAT_CTE`; with no beat, an identity that matches no row."""
    if beat is None:
        return {
            "beat_identity": None,
            "beat_held": 0,
            "beat_draining": False,
            "beat_leader": False,
            "beat_expires_in": 0.0,
        }
    return {
        "beat_identity": beat.identity,
        "beat_held": beat.held,
        "beat_draining": beat.draining,
        "beat_leader": beat.leader,
        "beat_expires_in": float(beat.expires_in),
    }
