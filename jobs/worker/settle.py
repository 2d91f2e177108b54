"""What follows an outcome's write: the release of waiting jobs, the tally, metrics and logs.

The completer (:mod:`jobs.worker.completer`) settles each batch of outcomes once the queue has
answered for them. By the report, by claim token: an outcome written is counted
(``jobs_outcomes_total``, one update a type and kind) and logged (a failure at warning, with
the terminal-failure hook); one fenced out (the lease was lost meanwhile) is counted and
logged as such; one handed back by a drain after its handler returned is counted as released.
A pass that ended a job others wait for wakes the release thread (:mod:`jobs.worker.release`).
The attempts the worker's pass wrote without counting them are added to the console's history
here too (:mod:`jobs.worker.history`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from jobs.db.sqlstate import one_line
from jobs.queue import Outcome, OutcomeReport
from jobs.runs import RunState
from jobs.worker import metrics
from jobs.worker.execution import Running
from jobs.worker.history import History

logger = logging.getLogger("jobs.worker")

# The outcome label of jobs_outcomes_total for a state an attempt ended in (else "retried").
_OUTCOME_KINDS: dict[str, str] = {
    RunState.SUCCEEDED: "succeeded",
    RunState.FAILED: "failed",
    RunState.CANCELLED: "cancelled",
}

#: Called with (job type name, job_id, error code, detail) when a job becomes failed.
TerminalHook = Callable[[str, str, str, str], None]


class Settler:
    """Settles written outcomes (see the module docstring)."""

    def __init__(
        self,
        *,
        using: str,
        terminal: TerminalHook,
        release: Callable[[], None],
        look_again_by: Callable[[float], None],
    ) -> None:
        self.history = History(using=using)
        self._history_failing = False
        self._terminal = terminal
        self._release = release
        self._look_again_by = look_again_by

    def settle(
        self,
        acks: Sequence[tuple[Running, Outcome | None]],
        outcomes: Sequence[tuple[Running, Outcome]],
        report: OutcomeReport | None,
    ) -> None:
        """``acks`` are done with; ``outcomes`` (of them) were sent, as ``report`` says."""
        if report is not None and report.settle:
            self._release()  # jobs wait for one this pass ended: release them now
        counted: Counter[tuple[str, str]] = Counter()  # one update a type and outcome
        for running, _ in acks:
            if running.completed:  # written by its handler's transaction (jobs.complete)
                completed = Outcome.succeeded(running.job)
                self.history.count_completed(running, completed)
                self._log_outcome(running, completed, counted)
        for running, outcome in outcomes:
            job = running.job
            # Nothing fenced: no token to look up.
            if report is not None and report.fenced and report.was_fenced(outcome):
                metrics.fenced_outcomes.labels(job.name).inc()
                logger.warning(
                    "outcome of job %s (%s) discarded: this worker no longer holds it",
                    job.job_id,
                    job.name,
                    extra={"job_id": job.job_id, "job_type": job.name, "action": "fenced"},
                )
                continue
            self._log_outcome(running, outcome, counted)
        for (name, kind), count in counted.items():
            metrics.for_type(name).outcome(kind).inc(count)

    def _log_outcome(
        self, running: Running, outcome: Outcome, counted: Counter[tuple[str, str]]
    ) -> None:
        """Log an outcome written, and add it to ``counted`` (by type and kind)."""
        job = running.job
        if outcome.attempts_delta < 0:  # handed back by a drain after its handler returned
            metrics.released.labels(job.name).inc()
            logger.warning(
                "handed back job %s (%s): its handler returned after being cancelled",
                job.job_id,
                job.name,
                extra={"job_id": job.job_id, "job_type": job.name, "action": "released"},
            )
            return
        kind = _OUTCOME_KINDS.get(outcome.state, "retried")
        counted[job.name, kind] += 1
        if kind == "retried" and outcome.at is None:
            # Written in the same statement as the next claim, which could not see it, and
            # announced by no NOTIFY: look again when it is due, not only at the next poll.
            self._look_again_by(time.monotonic() + outcome.delay)
        if kind == "succeeded" and not logger.isEnabledFor(logging.DEBUG):
            return
        duration = time.monotonic() - running.claimed_at
        extra = {
            "job_id": job.job_id,
            "job_type": job.name,
            "tenant": job.tenant,
            "attempt": running.ctx.attempt,
            "outcome": kind,
            "code": outcome.code or "",
            "duration": round(duration, 6),
            "action": "outcome",
        }
        if kind == "succeeded":
            logger.debug("job %s (%s) succeeded", job.job_id, job.name, extra=extra)
            return
        if kind == "cancelled":  # as an operator asked: nothing went wrong
            logger.info("job %s (%s) cancelled", job.job_id, job.name, extra=extra)
            return
        logger.warning(
            "job %s (%s) %s: %s",
            job.job_id,
            job.name,
            "failed" if kind == "failed" else "will retry",
            outcome.code,
            extra=extra,
        )
        if kind == "failed":
            self._terminal(job.name, job.job_id, outcome.code or "", outcome.detail or "")

    def flush_history(self, now: float | None = None, *, final: bool = False) -> None:
        """Add the counted attempts to the console's history (about once a second, and at a
        clean stop). A failure is logged once per streak and never stops the loop."""
        try:
            self.history.flush(now=now, force=final)
        except Exception as exc:
            if not self._history_failing or final:
                logger.warning(
                    "could not write the console's history (%s); %d attempts wait for the next try",
                    one_line(exc),
                    self.history.held,
                    extra={"action": "history_failed"},
                )
            self._history_failing = True
        else:
            self._history_failing = False
