"""Every state change of curation runs: start a pass, begin, beat, succeed, fail, rerun.

::

    start_pass / rerun ──▶ queued ──begin──▶ running ──succeed──▶ succeeded
                                              │ beat  └──fail────▶ failed ──rerun──▶ (a new run)

Each is one conditional statement; times come from PostgreSQL's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

import jobs
from jobs.runs import RunState
from project.curation.models import CurationRun


def key(collection: str) -> str:
    """A run's job_id: the active-state lock then allows one pass per collection at a time."""
    return f"curation-{collection}"


def start_pass(collection: str, *, by: str = "") -> CurationRun | None:
    """Queue a pass over ``collection``; None when a pass over it is already active."""
    from project.curation.jobs import CuratePassV1

    try:
        with transaction.atomic():
            run = CurationRun.objects.create(
                collection=collection, job_id=key(collection), requested_by=by
            )
            jobs.enqueue(CuratePassV1(run_id=run.pk), job_id=f"curation-run-{run.pk}")
    except IntegrityError:
        return None
    return run


def begin(run_id: int) -> CurationRun | None:
    changed = CurationRun.objects.filter(pk=run_id, state=RunState.QUEUED).update(
        state=RunState.RUNNING, heartbeat_at=Now()
    )
    return CurationRun.objects.get(pk=run_id) if changed else None


def beat(run_id: int, stats: dict[str, Any]) -> None:
    """The pass is alive: stamp the heartbeat and keep the step stats so far."""
    CurationRun.objects.filter(pk=run_id, state=RunState.RUNNING).update(
        heartbeat_at=Now(), stats=stats
    )


def succeed(run_id: int, stats: dict[str, Any]) -> None:
    CurationRun.objects.filter(pk=run_id, state=RunState.RUNNING).update(
        state=RunState.SUCCEEDED, stats=stats, finished_at=Now(), heartbeat_at=Now()
    )


def fail(run_id: int, *, code: str, detail: str, stats: dict[str, Any]) -> None:
    CurationRun.objects.filter(pk=run_id, state=RunState.RUNNING).update(
        state=RunState.FAILED, last_error=code, error_detail=detail, stats=stats, finished_at=Now()
    )


_RERUN = """
INSERT INTO curation_curationrun
    (job_id, collection, state, replay_of_id, requested_by, stats, last_error, error_detail,
     created_at)
SELECT r.job_id, r.collection, 'queued', r.id, %(by)s, '{}'::jsonb, '', '', now()
FROM curation_curationrun r
WHERE r.id = ANY(%(ids)s) AND r.state = 'failed'
ORDER BY r.id
ON CONFLICT DO NOTHING
RETURNING id
"""


def rerun(pks: Iterable[int], *, by: str) -> list[int]:
    """Start a new run for each failed run; returns the failed runs that were replayed.

    One INSERT … ON CONFLICT DO NOTHING: the unique ``replay_of`` makes a second replay of
    the same run (double click, two operators) insert nothing, and the active-state lock
    skips a collection that already has a pass queued or running.
    """
    from project.curation.jobs import CuratePassV1

    wanted = sorted(set(pks))
    if not wanted:
        return []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_RERUN, {"ids": wanted, "by": by})
        new_ids = sorted(new_id for (new_id,) in cur.fetchall())
        jobs.enqueue_many(
            jobs.JobSpec(payload=CuratePassV1(run_id=new_id), job_id=f"curation-run-{new_id}")
            for new_id in new_ids
        )
        replaced = CurationRun.objects.filter(pk__in=new_ids).values_list("replay_of", flat=True)
        return sorted(replaced)
