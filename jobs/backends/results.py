"""What ``get_result()`` reports of a finished task: its errors, one per failed attempt, and
the workers that ran it, read from the job row and the attempt log.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.tasks.base import TaskError

if TYPE_CHECKING:
    from jobs.queue.attempts import Attempt


# The exception line of a formatted traceback: "pkg.mod.Error: message" or "KeyError"; a
# class defined in a function has "<locals>" in its path.
_EXCEPTION_LINE = re.compile(r"^(?P<path>[A-Za-z_][\w.<>]*)(?::|$)")
_SURROGATE = re.compile("[\ud800-\udfff]")

_CODE_CLASSES = {
    "deadline_exceeded": "builtins.TimeoutError",
    "invalid_payload": "jobs.catalogue.payloads.InvalidPayload",
    "cancelled": "jobs.errors.Cancelled",
}
_TRACEBACK_HEADER = "Traceback (most recent call last):"
_CHAIN_SEPARATORS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# An exception group's header starts "  + "; the worker strips the detail's leading spaces.
_GROUP_HEADERS = (
    "  + Exception Group " + _TRACEBACK_HEADER,
    "+ Exception Group " + _TRACEBACK_HEADER,
)


def errors_of(job: Any, listed: Sequence[Attempt]) -> list[TaskError]:
    """An error per failed attempt, oldest first (``listed``: :func:`jobs.queue.attempts.of`).

    The last attempt's error is the row's own detail, which also explains a retry that is
    waiting. A row whose attempts were not recorded (written before the attempt log, or by
    hand) reports its last error alone.
    """
    errors = [_task_error(a.code, a.error) for a in listed if a.code]
    if not errors and job.last_error:
        errors = [_task_error(job.last_error, job.error_detail or "")]
    return errors


def _task_error(code: str, detail: str) -> TaskError:
    """One error as Django's ``TaskError``: the exception class read from the traceback.

    Details that are not a traceback (a deadline, an expired lease, a cancellation) are
    reported as ``"<code>: <detail>"`` with a class chosen by ``_CODE_CLASSES``.
    """
    path = _raised_class(detail)
    if path is None:
        path = _CODE_CLASSES.get(code, "builtins.Exception")
        detail = f"{code}: {detail}" if detail else code
    return TaskError(exception_class_path=path, traceback=detail)


def worker_ids(job: Any, listed: Sequence[Attempt]) -> list[str]:
    """The worker of each attempt, the running one included."""
    if not listed:  # attempts not recorded: the last worker, once per attempt
        return [job.claimed_by or "unknown"] * job.attempts
    return [a.worker or "unknown" for a in listed]


def _raised_class(detail: str) -> str | None:
    """The class of the exception a formatted traceback ends with; None if it is no traceback.

    Chained exceptions come first, each ended by a separator line; the last block's exception
    line is the first unindented line after its header (so a message quoting another
    traceback does not mislead), and the lines after it are the rest of its message and its
    notes. An exception group's lines carry a ``"  | "`` margin.
    """
    lines = detail.splitlines()
    last_block = max((i for i, line in enumerate(lines) if line in _CHAIN_SEPARATORS), default=-1)
    start = next(
        (
            i
            for i in range(last_block + 1, len(lines))
            if lines[i] == _TRACEBACK_HEADER or lines[i] in _GROUP_HEADERS
        ),
        None,
    )
    if start is None:
        return None
    margin = "" if lines[start] == _TRACEBACK_HEADER else "  | "
    for line in lines[start + 1 :]:
        if not line.startswith(margin):
            break
        line = line.removeprefix(margin)
        if line and not line[0].isspace():
            match = _EXCEPTION_LINE.match(line)
            if match is None:
                break
            found = match.group("path")
            # format_exception leaves out the module of builtins (and of __main__).
            return found if "." in found else f"builtins.{found}"
    return "builtins.Exception"  # cut short before the exception line (long details are)
