"""The lease keeper: renews every held lease in one statement, enforces handler deadlines.

Every third of the lease it renews the leases of all held jobs (stamping ``heartbeat_at``),
for as long as their handler runs: Python cannot stop a thread, and a lease that lapsed while
its handler still ran would let a second worker run the same job at the same time. A handler
past its timeout is told to stop (its attempt ends ``deadline_exceeded`` when it returns); one
that never returns holds its slot and its job until the process exits. A job whose renewal
finds its token gone has been taken away (a stall let the lease expire and a maintenance pass
or another worker moved it): the handler is told to stop and no outcome will be written.

So is a job whose lease ran out unrenewed. A renewal can hang where no timeout reaches (a
silent pooler or proxy), or for as long as TCP takes to notice a dead link, and the keeper's
thread waits with it. So a watch on a thread of its own tells each such handler to stop by
the time its lease could end on the server, a lease after the start of the last call that
set it, which is before another worker may take the job; and it aborts a renewal pass that
has not come back within a lease, so the next one reconnects.

A job whose handler already returned is not reported lost: its outcome write, which may have
just committed, says whether it was applied or fenced. The same statement refreshes the
process's row in ``jobs_process``, also when no job is held, so an idle worker stays live.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from jobs import queue
from jobs.core.conf import as_timedelta
from jobs.core.progress import Progress
from jobs.db import bounds as dbbounds
from jobs.queue import Outcome, ProcessBeat
from jobs.queue.outcomes import with_progress
from jobs.worker import metrics
from jobs.worker.execution import Running, run_rows

logger = logging.getLogger("jobs.worker")


class LeaseKeeper:
    def __init__(
        self,
        held: Callable[[], list[Running]],
        *,
        lease_seconds: float,
        tick: float = 0.1,
        beat: Callable[[], ProcessBeat | None] | None = None,
        beat_missed: Callable[[], None] | None = None,
        using: str = DEFAULT_DB_ALIAS,
    ) -> None:
        self._held = held
        self._using = using  # the worker's database alias: its jobs and its process row
        # The process's row rides in every renewal, held jobs or none (jobs.worker.presence);
        # a beat that found no row (pruned in a long stall) calls ``beat_missed``.
        self._beat = beat
        self._beat_missed = beat_missed
        self._lease = lease_seconds
        self._every = lease_seconds / 3
        self._tick = min(tick, self._every)
        self._stop = threading.Event()
        self._losing = threading.Lock()  # the renewals and the watch may both give a job up
        # The renewal pass in progress: when it began, and the connection it runs on.
        self._renewing_since: float | None = None
        self._aborted_pass: float | None = None
        self._connection: BaseDatabaseWrapper | None = None
        self._thread = threading.Thread(target=self._loop, name="jobs-lease-keeper", daemon=True)
        self._watch_thread = threading.Thread(
            target=self._watch, name="jobs-lease-watch", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        self._watch_thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        # The worker has settled or abandoned its jobs by now: a pass in flight, which may
        # hang on a silent path, must not hold its exit up (nor outlive it in this process).
        if self._renewing_since is not None:
            dbbounds.abort(self._connection)
        self._thread.join(timeout)
        self._watch_thread.join(timeout)

    def _loop(self) -> None:
        next_renewal = time.monotonic() + self._every
        # A renewal that cannot finish within a renewal interval is as good as failed.
        bounds = dbbounds.Bounds.from_settings()
        bounds = replace(
            bounds,
            statement_timeout=min(
                self._every, as_timedelta(bounds.statement_timeout).total_seconds()
            ),
        )
        try:
            with dbbounds.bounded(connections[self._using], bounds) as self._connection:
                while not self._stop.wait(self._tick):
                    now = time.monotonic()
                    if now < next_renewal:
                        continue
                    next_renewal = now + self._every
                    self._renewing_since = now
                    if self._stop.is_set():  # stop() looked before this pass began
                        self._renewing_since = None
                        break
                    try:
                        self.renew_once(now)
                    except Exception:  # the keeper must outlive anything: leases depend on it
                        logger.exception("lease keeper pass failed; carrying on")
                    finally:
                        self._renewing_since = None
        finally:
            connections[self._using].close()

    def _watch(self) -> None:
        """Deadlines and unrenewed leases, on a thread that no database call holds up."""
        while not self._stop.wait(self._tick):
            try:
                now = time.monotonic()
                self._enforce_deadlines(now)
                self._give_up_unrenewed(now)
            except Exception:
                logger.exception("lease watch pass failed; carrying on")

    def _give_up_unrenewed(self, now: float) -> None:
        """Stop the handlers whose lease may end within a tick; abort a pass a lease old."""
        for running in self._held():
            if not running.finished and now + self._tick >= running.leased_at + self._lease:
                self._lose(running, f"not renewed within its {self._lease:g}s lease")
        since = self._renewing_since
        if since is not None and since != self._aborted_pass and now - since >= self._lease:
            self._aborted_pass = since
            dbbounds.abort(self._connection)  # the call raises; the next pass reconnects

    def _enforce_deadlines(self, now: float) -> None:
        for running in self._held():
            ctx = running.ctx
            try:  # a handler may have assigned nonsense to its context's fields
                # A held job's clock starts with its handler (jobs.worker.slots), not its claim.
                overran = (
                    running.started
                    and not running.finished
                    and not ctx.cancelled.is_set()
                    and now > ctx.deadline
                )
            except Exception:
                continue
            if overran:
                logger.warning(
                    "job %s (%s) overran its %gs timeout; asking it to stop",
                    ctx.job_id,
                    ctx.name,
                    ctx.timeout,
                    extra={"job_id": ctx.job_id, "job_type": ctx.name, "action": "timeout"},
                )
                ctx.cancelled.set()

    def renew_once(self, now: float | None = None) -> set[int]:
        """Renew the leases of every held job; returns the ids of running handlers' lost leases."""
        now = time.monotonic() if now is None else now
        renewable = [r for r in self._held() if not r.lost]
        beat = self._process_beat()
        if not renewable and beat is None:
            return set()
        reports = _unsent_reports(renewable)
        try:
            renewal = queue.renew_leases(
                [r.job for r in renewable],
                lease=timedelta(seconds=self._lease),
                beat=beat,
                progress={token: report for token, (_, report) in reports.items()},
                runs=run_rows(renewable),
                using=self._using,
            )
        except Exception as exc:
            # No lease is given up here: the watch does once a job's lease may have ended.
            logger.log(  # an idle worker's beat: the run loop reports the outage already
                logging.WARNING if renewable else logging.DEBUG,
                "lease renewal of %d jobs failed (%s: %s)",
                len(renewable),
                type(exc).__name__,
                (str(exc).strip().splitlines() or [""])[0],
                extra={"action": "renew_failed"},
            )
            connections[self._using].close()
            return set()
        _mark_sent(renewable, reports, renewal.unsent)
        self._stop_cancelled(
            [r for r in renewable if r.job.claim_token in renewal.cancel_requested]
        )
        if renewal.beat_missed and self._beat_missed is not None:
            self._beat_missed()
        kept = [r for r in renewable if r.job.claim_token not in renewal.lost]
        for running in kept:  # their leases run from this call's start now (or later)
            if running.job.claim_token not in renewal.skipped:  # locked: not renewed
                running.leased_at = max(running.leased_at, now)
        self._log_run_beats(renewal.runs_failed)
        # Read after the renewal: an outcome is written only once its handler finished, so
        # a job that is not finished now cannot have lost its lease to our own outcome.
        losers = [r for r in renewable if r.job.claim_token in renewal.lost and not r.finished]
        for running in losers:
            self._lose(running, "its claim is gone")
        return {r.job.id for r in losers}

    def _lose(self, running: Running, why: str) -> None:
        """Tell the handler to stop; no outcome of this attempt will be written. Once."""
        with self._losing:
            if running.lost:
                return
            running.lost = True
        with contextlib.suppress(Exception):
            running.ctx.cancelled.set()
        metrics.lost_leases.labels(running.job.name).inc()
        logger.warning(
            "lost the lease of job %s (%s), %s; cancelling its handler, writing no outcome",
            running.job.job_id,
            running.job.name,
            why,
            extra={
                "job_id": running.job.job_id,
                "job_type": running.job.name,
                "action": "lease_lost",
            },
        )

    def _stop_cancelled(self, asked: list[Running]) -> None:
        """An operator asked these attempts to stop: tell their handlers; they end cancelled."""
        for running in asked:
            if running.finished or running.cancel_requested:
                continue
            running.cancel_requested = True
            with contextlib.suppress(Exception):
                running.ctx.cancelled.set()
            logger.warning(
                "job %s (%s) was cancelled by an operator; asking its handler to stop",
                running.job.job_id,
                running.job.name,
                extra={
                    "job_id": running.job.job_id,
                    "job_type": running.job.name,
                    "action": "cancel_requested",
                },
            )

    def _process_beat(self) -> ProcessBeat | None:
        """The beat for this renewal; a failing provider must not stop the leases' renewal."""
        if self._beat is None:
            return None
        try:
            return self._beat()
        except Exception:
            logger.exception("could not build the process beat; renewing leases without it")
            return None

    def _log_run_beats(self, failed: tuple[tuple[str, Exception], ...]) -> None:
        """Bound run rows (policy.run_model) share their job's heartbeat, which the renewal
        stamps (jobs.queue.bound): a table whose update failed is logged."""
        for label, exc in failed:
            logger.error("heartbeat of %s rows failed", label, exc_info=exc)
            connections[self._using].close()


def _unsent_reports(renewable: list[Running]) -> dict[UUID, tuple[int, Progress]]:
    """The handlers' progress reports the row does not have yet, by claim token."""
    reports: dict[UUID, tuple[int, Progress]] = {}
    for running in renewable:
        try:  # a handler may have assigned nonsense to its context
            unsent = running.ctx.unsent_progress()
        except Exception:
            continue
        if unsent is not None:
            reports[running.job.claim_token] = unsent
    return reports


def _mark_sent(
    renewable: list[Running], reports: dict[UUID, tuple[int, Progress]], unsent: frozenset[UUID]
) -> None:
    """Reports the renewal wrote are sent: the next renewal carries only newer ones."""
    for running in renewable:
        token = running.job.claim_token
        if token in reports and token not in unsent:
            with contextlib.suppress(Exception):
                running.ctx.progress_sent(reports[token][0])


def with_last_report(running: Running, outcome: Outcome) -> Outcome:
    """The outcome carrying the handler's last progress report, if no renewal wrote it."""
    try:
        unsent = running.ctx.unsent_progress()
        return with_progress(outcome, unsent[1] if unsent else None)
    except Exception:  # a nonsense context, an unstorable note: the outcome matters more
        return outcome
