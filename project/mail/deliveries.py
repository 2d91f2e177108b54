"""Every state change of delivery rows: create, start, delivered, not delivered, resend.

::

    pending (queued) ──start──▶ sending (running) ──▶ delivered (succeeded)
          ▲                        │   └────────────▶ not delivered (failed)
          └──── retrying ──────────┘                        │
          └───────────────── resend (replay) ───────────────┘

Each is one conditional statement; times come from PostgreSQL's clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db import connection, transaction
from django.db.models.functions import Now

import jobs
from jobs.runs import RunState
from project.mail.models import Delivery
from project.redo import redo


def send(to: str, subject: str, body: str = "", *, key: str) -> Delivery:
    """Record a message and enqueue its delivery, together or not at all."""
    from project.mail.jobs import DeliverMailV1

    with transaction.atomic():
        delivery = Delivery.objects.create(to=to, subject=subject, body=body, job_id=key)
        job = jobs.enqueue(
            DeliverMailV1(delivery_id=delivery.pk), job_id=f"mail-delivery-{delivery.pk}"
        )
        Delivery.objects.filter(pk=delivery.pk).update(job_pk=job.id)
        delivery.job_pk = job.id
    return delivery


def start(pk: int, *, attempt: int) -> Delivery | None:
    """Mark a pending (or undelivered, when its job was replayed) message as sending."""
    changed = Delivery.objects.filter(pk=pk, state__in=[RunState.QUEUED, RunState.FAILED]).update(
        state=RunState.RUNNING, attempts=attempt, heartbeat_at=Now(), finished_at=None
    )
    return Delivery.objects.get(pk=pk) if changed else None


def delivered(pk: int) -> None:
    Delivery.objects.filter(pk=pk, state=RunState.RUNNING).update(
        state=RunState.SUCCEEDED,
        sent_at=Now(),
        finished_at=Now(),
        heartbeat_at=Now(),
        last_error="",
        error_detail="",
    )


def retrying(pk: int, *, code: str, detail: str) -> None:
    """The attempt failed and the job will retry: back to pending, with the reason."""
    Delivery.objects.filter(pk=pk, state=RunState.RUNNING).update(
        state=RunState.QUEUED, last_error=code, error_detail=detail, heartbeat_at=Now()
    )


def not_delivered(pk: int, *, code: str, detail: str) -> None:
    """The message will not go out unless someone resends it."""
    Delivery.objects.filter(pk=pk, state=RunState.RUNNING).update(
        state=RunState.FAILED, last_error=code, error_detail=detail, finished_at=Now()
    )


def record_failure(
    to: str, subject: str, *, key: str, code: str, detail: str, finished_at: datetime
) -> Delivery:
    """A message that was not delivered elsewhere (imported history); resend to retry it."""
    return Delivery.objects.create(
        to=to,
        subject=subject,
        job_id=key,
        state=RunState.FAILED,
        attempts=1,
        last_error=code,
        error_detail=detail,
        finished_at=finished_at,
    )


_RESEND = """
WITH target AS (
    SELECT d.id FROM mail_delivery d
    WHERE d.id = ANY(%(ids)s) AND d.state = 'failed'
      AND NOT EXISTS (
          SELECT 1 FROM mail_delivery o
          WHERE o.job_id = d.job_id AND o.state IN ('queued', 'running') AND o.id <> d.id
      )
    ORDER BY d.id
    FOR UPDATE OF d
)
UPDATE mail_delivery d
SET state = 'queued', attempts = 0, finished_at = NULL, heartbeat_at = NULL,
    resends = d.resends + 1
FROM target WHERE d.id = target.id
RETURNING d.id, d.resends, d.job_pk
"""


def resend(pks: Iterable[int], *, by: str) -> list[int]:
    """Send undelivered messages again: back to pending, each with its delivery job replayed.

    Replaying the message's own job (see :mod:`project.redo`) leaves no failed job behind once
    it is delivered; a message whose job is gone (imported history, pruned) gets a new one.
    The conditional statement is the idempotency: a second resend of the same row (a double
    click, two operators) waits for the first one's row lock, then finds it no longer
    undelivered. Rows are locked in id order, so overlapping bulk resends cannot deadlock.
    """
    from project.mail.jobs import DeliverMailV1

    wanted = sorted(set(pks))
    if not wanted:
        return []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(_RESEND, {"ids": wanted})
        rows = sorted(cur.fetchall())
        resends = {pk: n for pk, n, _job in rows}
        redo(
            Delivery,
            {pk: job for pk, _n, job in rows},
            lambda pk: jobs.JobSpec(
                payload=DeliverMailV1(delivery_id=pk),
                job_id=f"mail-delivery-{pk}-resend-{resends[pk]}",
            ),
            by=by,
        )
    return [pk for pk, _n, _job in rows]
