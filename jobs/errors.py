"""Exceptions a handler raises to say how its attempt ended (besides returning normally).

* :class:`Reject` — the payload is valid but the work can never succeed (the user is gone,
  the order was refunded). Terminal at once: ``failed`` / ``rejected``, no retry.
* :class:`RetryAfter` — try again after ``delay`` (an upstream 429 or 503 with Retry-After).
  Short delays are waited out in the worker; long ones go back to the queue.
* Any other exception is classified by the job type's policy: transient errors (the default)
  retry with backoff until attempts run out; permanent ones fail at once as ``rejected``.
* :func:`fail_now` marks any other exception to end its job as ``Reject`` does, keeping its
  own class and traceback in the job's error.
"""

from __future__ import annotations

from datetime import timedelta

# The attribute fail_now sets on an exception.
_FAIL_NOW = "_jobs_fail_now"


class Reject(Exception):
    """The job can never complete; fail it now without retrying."""


class RetryAfter(Exception):
    """Retry this job after ``delay`` (seconds or a timedelta).

    With ``throttle=True`` the upstream told the handler to slow down for everyone: no worker
    starts another job of this type for ``delay`` either (a timed pause of the type, shown on
    the admin's Pauses page, which an operator may resume early).
    """

    def __init__(
        self, delay: timedelta | float, message: str = "", *, throttle: bool = False
    ) -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if seconds < 0:
            raise ValueError("RetryAfter delay must not be negative")
        self.delay = seconds
        self.throttle = throttle
        super().__init__(message or f"retry requested after {seconds:g}s")


class Cancelled(Exception):
    """Raised by :meth:`jobs.JobContext.raise_if_cancelled` once the worker asked to stop."""


class LeaseLost(Exception):
    """This attempt no longer holds its job: a write made on its behalf was refused.

    Raised by :func:`jobs.complete` (the enclosing transaction must roll back, taking the
    business write with it) and by the effect journal (:func:`jobs.effect`). Another attempt
    owns the job now, or it has finished: the handler should stop; the worker writes no
    outcome for a lost lease.
    """


def fail_now[E: BaseException](error: E) -> E:
    """Mark ``error`` to end its job at once as ``rejected``, as :class:`Reject` does, while the
    job's error keeps the class and traceback of ``error`` itself.

    For errors no retry can fix that are not a ``Reject``: the ``django.tasks`` backend marks
    so a return value that is not JSON and a ``SystemExit``, which Django reports under their
    own classes. Returns ``error``.
    """
    setattr(error, _FAIL_NOW, True)
    return error


def fails_now(error: BaseException) -> bool:
    """Whether :func:`fail_now` marked ``error``."""
    return getattr(error, _FAIL_NOW, False) is True
