"""A handler's progress report: how far it got, out of how much, and a short note.

A handler reports with :meth:`jobs.JobContext.progress`, which only keeps the latest report
in memory. The worker's next lease renewal (every third of the lease) writes it to the job's
``progress`` column in the statement it makes anyway, and the outcome write carries the last
one, so reporting costs no statement of its own however often it is called. The admin and
``get_result()`` read the column back with :func:`read`.

Imports nothing of the queue or the models: the context and the tasks backend load it early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: A longer note is cut to this many characters.
NOTE_MAX = 200
#: ``done`` and ``total`` fit a bigint, so every reader of the JSON can hold them.
COUNT_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Progress:
    """``done`` of ``total`` (None: not known), a note, and the attempt that reported it."""

    done: int
    total: int | None = None
    note: str = ""
    attempt: int | None = None

    @property
    def percent(self) -> int | None:
        """Whole percent done, rounded down (99 until the last item); None without a total."""
        if not self.total:
            return None
        return self.done * 100 // self.total

    def as_json(self) -> dict[str, Any]:
        """The report as the ``progress`` column stores it."""
        data: dict[str, Any] = {"done": self.done, "total": self.total, "note": self.note}
        if _count_or_none(self.attempt) is not None:
            data["attempt"] = self.attempt
        return data


def report(
    done: int, total: int | None = None, note: str = "", attempt: int | None = None
) -> Progress:
    """A checked report: TypeError for a value of the wrong type, ValueError for one out of range.

    ``done`` and ``total`` are non-negative ints (not bools), ``done`` at most ``total`` when
    a total is given; ``note`` is a string, cut to :data:`NOTE_MAX` characters.
    """
    _count("done", done)
    if total is not None:
        _count("total", total)
        if done > total:
            raise ValueError(f"progress: done ({done}) is more than total ({total})")
    if not isinstance(note, str):
        raise TypeError(f"progress: note must be a str, not {type(note).__name__}")
    # The attempt comes from the handler's context, whose fields a handler could overwrite.
    return Progress(done, total, note[:NOTE_MAX], _count_or_none(attempt))


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"progress: {name} must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"progress: {name} must not be negative (got {value})")
    if value > COUNT_MAX:
        raise ValueError(f"progress: {name} must be at most {COUNT_MAX} (got a larger int)")


def read(value: Any) -> Progress | None:
    """The report a ``progress`` column holds; None for none, or for a value not of this shape
    (a row written by hand), so a reader never fails on it."""
    if not isinstance(value, dict):
        return None
    done, total = _count_or_none(value.get("done")), _count_or_none(value.get("total"))
    if done is None or (total is None and value.get("total") is not None):
        return None
    if total is not None and done > total:
        return None
    note = value.get("note")
    return Progress(
        done,
        total,
        note[:NOTE_MAX] if isinstance(note, str) else "",
        _count_or_none(value.get("attempt")),
    )


def _count_or_none(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= COUNT_MAX:
        return value
    return None
