"""Fan-out and fan-in: enqueue a group of jobs, and one successor when all have finished.

::

    with transaction.atomic():
        order = Import.objects.create(...)
        with jobs.batch(successor=SendReport(import_id=order.pk)) as batch:
            for row in rows:
                batch.enqueue(ImportRow(import_id=order.pk, row=row))

The successor is enqueued once, when every member has finished, whatever the mix of
successes and failures; its handler reads the counts and the failures with
:meth:`Batch.finished_by`. The guarantee and its edges (crashes, replays, retention) are in
:mod:`jobs.queue.batches` and ``docs/workflows.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction

from jobs.api.producer import JobSpec, new_jobs, routed
from jobs.catalogue import routing as databases
from jobs.catalogue.payloads import Payload

if TYPE_CHECKING:
    from jobs.core.context import JobContext
    from jobs.queue import BatchFailure, BatchState, Enqueued


@dataclass(frozen=True)
class Batch:
    """A handle on one batch: add members, seal it, read its counts and failures.

    ``using`` is the batch's database alias; by default ``JOBS["DATABASE"]``, where
    :func:`jobs.enqueue` puts unbound types' jobs.
    """

    id: int
    using: str = field(default_factory=databases.home)

    @classmethod
    def open(
        cls,
        successor: Payload | JobSpec | None = None,
        *,
        tenant: str | None = None,
        description: str = "",
        by: str = "",
        using: str | None = None,
    ) -> Batch:
        """Make an open batch. Add members, then :meth:`seal` it (``jobs.batch()`` does both).

        ``successor`` is validated now and enqueued when the sealed batch's last member has
        finished; a batch without one just records its counts.
        """
        from jobs.queue import batches

        using = using or databases.home()
        template = None if successor is None else new_jobs([successor], {})[0]
        if template is not None:
            routed([template], using)  # refused unless its type's workers look in ``using``
        return cls(
            batches.open(template, tenant=tenant, description=description, by=by, using=using),
            using,
        )

    @classmethod
    def of(cls, ctx: JobContext) -> Batch | None:
        """The batch the running job is a member of (to add members to it), if any."""
        from jobs.queue import batches

        batch_id = batches.of_member(ctx.id, using=ctx.using)
        return None if batch_id is None else cls(batch_id, ctx.using)

    @classmethod
    def finished_by(cls, ctx: JobContext) -> Batch | None:
        """The batch whose successor the running job is, if any."""
        from jobs.queue import batches

        batch_id = batches.of_successor(ctx.id, using=ctx.using)
        return None if batch_id is None else cls(batch_id, ctx.using)

    def enqueue(self, payload: Payload | JobSpec, **options: Any) -> Enqueued:
        """Add one member; takes :func:`jobs.enqueue`'s options."""
        return self.enqueue_many([payload], **options)[0]

    def enqueue_many(
        self,
        items: Iterable[Payload | JobSpec],
        *,
        tenant: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        run_after: datetime | None = None,
        delay: timedelta | float | None = None,
        max_attempts: int | None = None,
        after: Sequence[Enqueued | int | str] | None = None,
        on_dependency_failure: str | None = None,
    ) -> list[Enqueued]:
        """Add members atomically, as :func:`jobs.enqueue_many` enqueues jobs.

        Raises ``jobs.queue.batches.BatchClosed`` once the batch has finished.
        """
        from jobs.queue import batches

        shared = {
            "tenant": tenant,
            "queue": queue,
            "priority": priority,
            "run_after": run_after,
            "delay": delay,
            "max_attempts": max_attempts,
            "after": after,
            "on_dependency_failure": on_dependency_failure,
        }
        members = new_jobs(items, shared, using=self.using)
        return batches.add(self.id, members, using=routed(members, self.using))

    def seal(self) -> bool:
        """No more members from the creator; True when this fired the successor."""
        from jobs.queue import batches

        return batches.seal(self.id, using=self.using)

    def state(self) -> BatchState:
        """The counts now: total, succeeded, failed, cancelled, and whether it has fired."""
        from jobs.queue import batches

        return batches.get(self.id, using=self.using)

    def failures(self, *, limit: int = 1000) -> list[BatchFailure]:
        """Members that failed or were cancelled (those not yet removed by retention)."""
        from jobs.queue import batches

        return batches.failures(self.id, limit=limit, using=self.using)


@contextmanager
def batch(
    successor: Payload | JobSpec | None = None,
    *,
    tenant: str | None = None,
    description: str = "",
    by: str = "",
    using: str | None = None,
) -> Iterator[Batch]:
    """Open a batch, yield it to add members, and seal it, all in one transaction.

    An exception in the block rolls the batch and its members back together. ``using`` is
    the database alias (default ``JOBS["DATABASE"]``); the transaction is that alias's.
    """
    using = using or databases.home()
    with transaction.atomic(using=using):
        handle = Batch.open(successor, tenant=tenant, description=description, by=by, using=using)
        yield handle
        handle.seal()
