"""The retention duty: delete what no one needs any more, in bounded batches.

* Jobs table (``jobs.queue.prune``): succeeded rows after ``SUCCEEDED_RETENTION`` (short, but
  never shorter than the idempotency window ``SUCCESS_WINDOW``: system check ``jobs.E005``),
  failed rows after ``FAILED_RETENTION`` (long, for inspection and replay), cancelled rows
  after ``CANCELLED_RETENTION``. Queued and running rows are never touched.
* History table (``jobs.queue.history``): whole partitions of finished rows, once the newest
  row a partition may hold is past its state's retention (``DROP TABLE``, no row deletes).
* Batches (``jobs.queue.batches``) finished ``BATCH_RETENTION`` ago, and batches never
  sealed that old with no member left in the jobs table.
* Recorded cron slots after ``SLOT_RETENTION``, except each schedule's latest slot, which the
  next tick needs to know what it missed.
* The console's history (``jobs.queue.rollup``): minute rows folded into hours after two
  hours, hour rows deleted after ``ROLLUP_RETENTION``.
* Rows of processes gone (``jobs_process``: no beat before their ``expires_at``, a process
  killed outright) for ``PROCESS_RETENTION``.

Run outside a transaction: each batch commits on its own, so no statement holds locks long.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections

from jobs import queue
from jobs.core.conf import jobs_settings
from jobs.db.clock import database_now
from jobs.queue import effects as effect_journal
from jobs.queue import processes
from jobs.runs import TERMINAL_STATES
from jobs.scheduler import metrics, slots

logger = logging.getLogger("jobs.scheduler")


@dataclass(frozen=True)
class RetentionConfig:
    batch_size: int | None = None  # rows per statement; None: JOBS["PRUNE_BATCH_SIZE"]
    max_batches: int = 10  # statements per table and state per pass
    slot_retention: timedelta | None = None  # None: JOBS["SLOT_RETENTION"]
    process_retention: timedelta | None = None  # None: JOBS["PROCESS_RETENTION"]

    def __post_init__(self) -> None:
        if (self.batch_size is not None and self.batch_size < 1) or self.max_batches < 1:
            raise ImproperlyConfigured(
                f"retention batch size and batches per pass must be at least 1, got "
                f"{self.batch_size} and {self.max_batches}"
            )


@dataclass(frozen=True)
class ArchiveConfig:
    batch_size: int = 5000  # rows moved per statement
    max_batches: int = 20  # statements per state and pass
    budget: float = 2.0  # seconds after which a pass starts no new statement

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_batches < 1 or self.budget <= 0:
            raise ImproperlyConfigured(
                f"archive batch size and batches per pass must be at least 1 and its budget "
                f"positive, got {self.batch_size}, {self.max_batches} and {self.budget}"
            )


class Archive:
    """The archive duty: finished rows that hold no key leave the jobs table for its history.

    Frequent and small (every few seconds, bounded in rows and time), so the jobs table
    stays the size of the active work however many jobs finish. Each pass first makes the
    history ready for the rows finishing in the hours ahead, so that a statement ending a job
    can write its row there itself (``jobs.queue.history.prepare_ahead``): one catalog read
    when it already is.
    """

    def __init__(self, config: ArchiveConfig | None = None, *, using: str = DEFAULT_DB_ALIAS):
        self.config = config or ArchiveConfig()
        self.using = using

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Archive at ``now`` (default: database clock); rows moved by state."""
        counts: Counter[str] = Counter()
        queue.history.prepare_ahead(now=now, using=self.using)
        moved = queue.history.archive(
            batch_size=self.config.batch_size,
            max_batches=self.config.max_batches,
            budget=self.config.budget,
            now=now,
            using=self.using,
        )
        for state, (taken, kept) in moved.items():
            if kept:
                counts[state] += kept
                metrics.archived.labels(state).inc(kept)
            if taken - kept:
                metrics.pruned.labels("jobs.job", state).inc(taken - kept)
        if counts:
            logger.debug(
                "archive: moved %s",
                ", ".join(f"{count} {state}" for state, count in sorted(counts.items())),
                extra={"action": "archived", "counts": dict(counts)},
            )
        return counts


class Retention:
    def __init__(self, config: RetentionConfig | None = None, *, using: str = DEFAULT_DB_ALIAS):
        self.config = config or RetentionConfig()
        self.using = using

    def run_once(self, now: datetime | None = None) -> Counter[str]:
        """Prune at ``now`` (default: database clock); counts by ``table:state``."""
        now = now or database_now(self.using)
        batch_size = self.config.batch_size or jobs_settings.PRUNE_BATCH_SIZE
        counts: Counter[str] = Counter()
        deleted = queue.prune(
            batch_size=batch_size, max_batches=self.config.max_batches, now=now, using=self.using
        )
        for state, count in deleted.items():
            if count:
                counts[f"jobs.job:{state}"] += count
        for state, count in queue.history.drop_expired(now=now, using=self.using).items():
            if count:
                counts[f"jobs.jobhistory:{state}"] += count
        # The effect journal of jobs gone from both tables, after this pass removed them.
        counts["jobs.effect:gone"] += effect_journal.prune(
            older_than=min(queue.history.retention(state) for state in TERMINAL_STATES),
            batch_size=batch_size,
            max_batches=self.config.max_batches,
            now=now,
            using=self.using,
        )
        counts["jobs.batch:finished"] += queue.batches.prune(
            older_than=jobs_settings.BATCH_RETENTION,
            batch_size=batch_size,
            max_batches=self.config.max_batches,
            now=now,
            using=self.using,
        )
        retention = self.config.slot_retention or jobs_settings.SLOT_RETENTION
        with connections[self.using].cursor() as cur:
            for _ in range(self.config.max_batches):
                count = slots.prune(cur, before=now - retention, batch_size=batch_size)
                counts["jobs.scheduleslot:recorded"] += count
                if count < batch_size:
                    break
        compacted = queue.rollup_compaction.compact(
            now, batch_size=batch_size, max_batches=self.config.max_batches, using=self.using
        )
        counts["jobs.rollup:expired"] += compacted["expired"]
        counts["jobs.process:gone"] += processes.prune_gone(
            older_than=self.config.process_retention, limit=batch_size, now=now, using=self.using
        )
        counts = +counts  # drop zeros
        for key, count in counts.items():
            table, state = key.split(":")
            metrics.pruned.labels(table, state).inc(count)
        if counts:
            logger.info(
                "retention: deleted %s",
                ", ".join(f"{count} {key}" for key, count in sorted(counts.items())),
                extra={"action": "pruned", "counts": dict(counts)},
            )
        return counts
