"""Every state change of dead-letter rows, and of the items' harvest results.

::

    harvest fails for good ──dead_letter──▶ failed ──repick (replay)──▶ queued
                                             │  ▲                          │
                              start (its job │  └───── dead_letter ──┐     │ start
                        replayed, or another │                       │     │
                           harvest of it)    └─────────────────▶ running ◀─┘
                                                                    │ harvested
                                                                    ▼
                                                                succeeded

A harvest of the item, by whichever job (a re-pick, or the failed job replayed from the jobs
table), works on the item's open dead letter and resolves it once the item is harvested.
Each is one conditional statement; times come from PostgreSQL's clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Now

import jobs
from jobs.runs import ACTIVE_STATES, RunState
from project.harvester.models import DeadLetter, Item
from project.harvester.sources import Page
from project.redo import redo

OPEN_STATES = (*ACTIVE_STATES, RunState.FAILED)  # a dead letter not yet resolved


def key(item_id: int) -> str:
    """The dead-letter row's job_id: one active re-pick per item."""
    return f"harvest-item-{item_id}"


def harvested(item_id: int, page: Page) -> None:
    """Store the fetched page and resolve the item's open dead letter, if any.

    Whatever job harvested the item, the failure its dead letter records is solved.
    """
    with transaction.atomic():
        Item.objects.filter(pk=item_id).update(
            title=page.title, content=page.content, harvested_at=Now()
        )
        DeadLetter.objects.filter(item_id=item_id, state__in=OPEN_STATES).update(
            state=RunState.SUCCEEDED, finished_at=Now(), heartbeat_at=Now()
        )


def start(item_id: int) -> bool:
    """A harvest of the item begins: its open dead letter, if any, is running, with a heartbeat.

    Queued after a re-pick, or still failed when its job was replayed from the jobs table.
    """
    return bool(
        DeadLetter.objects.filter(item_id=item_id, state__in=OPEN_STATES).update(
            state=RunState.RUNNING, heartbeat_at=Now(), finished_at=None
        )
    )


def dead_letter(item_id: int, *, code: str, detail: str, job: int) -> None:
    """The item failed to harvest for good in ``job``: fail its open dead letter, or open one."""
    with transaction.atomic():
        changed = DeadLetter.objects.filter(item_id=item_id, state__in=OPEN_STATES).update(
            state=RunState.FAILED,
            attempts=F("attempts") + 1,
            last_error=code,
            error_detail=detail,
            finished_at=Now(),
            job_pk=job,
        )
        if not changed:
            DeadLetter.objects.create(
                item_id=item_id,
                job_id=key(item_id),
                state=RunState.FAILED,
                attempts=1,
                last_error=code,
                error_detail=detail,
                finished_at=Now(),
                job_pk=job,
            )


_REPICK = """
WITH target AS (
    SELECT d.id FROM harvester_deadletter d
    WHERE d.id = ANY(%(ids)s) AND d.state = 'failed'
      AND NOT EXISTS (
          SELECT 1 FROM harvester_deadletter o
          WHERE o.job_id = d.job_id AND o.state IN ('queued', 'running') AND o.id <> d.id
      )
    ORDER BY d.id
    FOR UPDATE OF d
)
UPDATE harvester_deadletter d
SET state = 'queued', finished_at = NULL, heartbeat_at = NULL
FROM target WHERE d.id = target.id
RETURNING d.id, d.item_id, d.attempts, d.job_pk
"""


def repick(pks: Iterable[int], *, by: str) -> list[int]:
    """Re-pick dead-lettered items: each row goes back to queued, its failed job replayed.

    Replaying the job that failed (see :mod:`project.redo`) leaves no failed job behind once
    the item is harvested; a dead letter whose job is gone gets a new harvest job. The item is
    read afresh when the job runs, so a fixed URL is picked up. The conditional statement
    makes a second re-pick of the same row (double click, two operators) a no-op; rows are
    locked in id order, so overlapping bulk re-picks cannot deadlock.
    """
    from project.harvester.jobs import HarvestItemV1

    wanted = sorted(set(pks))
    if not wanted:
        return []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_REPICK, {"ids": wanted})
        rows = {pk: (item_id, attempts, job) for pk, item_id, attempts, job in cur.fetchall()}

        def new_job(pk: int) -> jobs.JobSpec:
            item_id, attempts, _job = rows[pk]
            return jobs.JobSpec(
                payload=HarvestItemV1(item_id=item_id, dead_letter_id=pk),
                job_id=f"{key(item_id)}-repick-{pk}-{attempts}",
            )

        redo(DeadLetter, {pk: job for pk, (_i, _a, job) in rows.items()}, new_job, by=by)
    return sorted(rows)
