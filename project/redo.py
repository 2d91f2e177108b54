"""Redo a domain row's work with the job that did it, so one replay resolves both of its homes.

A failure of the example apps shows twice in the failure monitor: the failed job and the
domain's row (a delivery, a dead letter, a curation run). Each row records the job working on
it (``job_pk``), and replaying the row replays that same job (:func:`jobs.queue.replay`), so
once the work succeeds no failed job is left behind to be replayed again. Only a row whose job
is gone (pruned by retention, or there never was one) gets a new job; a job that is still
queued or running needs nothing: it will do the work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from django.db import models

import jobs
from jobs import queue
from jobs.models import Job
from jobs.runs import ACTIVE_STATES


def redo[K](
    model: type[models.Model],
    links: Mapping[K, int | None],
    new_job: Callable[[K], jobs.JobSpec],
    *,
    by: str,
) -> None:
    """Replay the job of each row (``links``: row pk → job pk); enqueue ``new_job(row)`` where
    none is left to run, and record it as the row's ``job_pk``.

    Call it in the transaction that moved the rows, so rows and jobs commit together.
    """
    known = {job for job in links.values() if job is not None}
    will_run = set(queue.replay(known, by=by).replayed)
    active = Job.objects.filter(pk__in=known - will_run, state__in=ACTIVE_STATES)
    will_run.update(active.values_list("pk", flat=True))
    orphans = [row for row, job in links.items() if job not in will_run]
    enqueued = jobs.enqueue_many([new_job(row) for row in orphans])
    model._default_manager.bulk_update(
        [model(pk=row, job_pk=job.id) for row, job in zip(orphans, enqueued, strict=True)],
        ["job_pk"],
    )
