"""Every state change of curation runs: start a pass, begin, beat, succeed, fail, rerun.

::

    start_pass / rerun ──▶ queued ──begin──▶ running ──succeed──▶ succeeded
                                              │ beat  └──fail────▶ failed ──rerun──▶ (a new run)

A run's pass job is recorded on it (``job_pk``). ``rerun`` gives the new run the failed run's
job and replays that job, so the failed job is resolved with the run; when that job itself is
replayed from the jobs table, ``begin`` finds its run failed and starts the new run there.
Each is one conditional statement; times come from PostgreSQL's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

import jobs
from jobs.models import Job
from jobs.runs import RunState
from project.curation.models import CurationRun
from project.redo import redo


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
            job = jobs.enqueue(CuratePassV1(run_id=run.pk), job_id=f"curation-run-{run.pk}")
            CurationRun.objects.filter(pk=run.pk).update(job_pk=job.id)
            run.job_pk = job.id
    except IntegrityError:
        return None
    return run


# The job's run: the one recorded with it, or the payload's run from before job_pk existed.
_OF_JOB = "(r.job_pk = %(job)s OR (r.id = %(run)s AND r.job_pk IS NULL))"

_BEGIN = f"""
UPDATE curation_curationrun r SET state = 'running', heartbeat_at = now()
WHERE r.state = 'queued' AND {_OF_JOB}
RETURNING r.id
"""

_TAKE_OVER = f"""
INSERT INTO curation_curationrun
    (job_id, collection, state, replay_of_id, requested_by, stats, last_error, error_detail,
     created_at, heartbeat_at, job_pk)
SELECT r.job_id, r.collection, 'running', r.id, %(by)s, '{{}}'::jsonb, '', '', now(), now(),
       %(job)s
FROM curation_curationrun r
WHERE r.state = 'failed' AND {_OF_JOB}
  AND NOT EXISTS (SELECT 1 FROM curation_curationrun n WHERE n.replay_of_id = r.id)
ON CONFLICT DO NOTHING
RETURNING id
"""


def begin(run_id: int, *, job: int) -> CurationRun | None:
    """The pass job ``job`` (payload ``run_id``) starts: its queued run becomes running.

    A job replayed from the jobs table finds its run failed instead. A pass is never
    retried, so it starts a new run replacing the failed one, as replaying the run would.
    None when there is nothing to do: a repeat delivery of a finished pass, or another pass
    over the collection is active (the failed run then stays open for a later replay).
    """
    params = {"job": job, "run": run_id}
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_BEGIN, params)
        row = cur.fetchone()
        if row is None:
            by = Job.objects.filter(pk=job).values_list("replayed_by", flat=True).first()
            cur.execute(_TAKE_OVER, {**params, "by": by or ""})
            row = cur.fetchone()
    return CurationRun.objects.get(pk=row[0]) if row else None


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
     created_at, job_pk)
SELECT r.job_id, r.collection, 'queued', r.id, %(by)s, '{}'::jsonb, '', '', now(), r.job_pk
FROM curation_curationrun r
WHERE r.id = ANY(%(ids)s) AND r.state = 'failed'
ORDER BY r.id
ON CONFLICT DO NOTHING
RETURNING id, job_pk
"""


def rerun(pks: Iterable[int], *, by: str) -> list[int]:
    """Start a new run for each failed run; returns the failed runs that were replayed.

    Each new run is worked on by the failed run's pass job, replayed (see
    :mod:`project.redo`), or by a new pass job when that one is gone. One INSERT … ON
    CONFLICT DO NOTHING: the unique ``replay_of`` makes a second replay of the same run
    (double click, two operators) insert nothing, and the active-state lock skips a
    collection that already has a pass queued or running.
    """
    from project.curation.jobs import CuratePassV1

    wanted = sorted(set(pks))
    if not wanted:
        return []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_RERUN, {"ids": wanted, "by": by})
        links = dict(cur.fetchall())
        redo(
            CurationRun,
            links,
            lambda new_id: jobs.JobSpec(
                payload=CuratePassV1(run_id=new_id), job_id=f"curation-run-{new_id}"
            ),
            by=by,
        )
        replaced = CurationRun.objects.filter(pk__in=links).values_list("replay_of", flat=True)
        return sorted(replaced)
