"""Operator input, checked before it reaches the database.

PostgreSQL refuses text holding a NUL character or a lone surrogate
(:func:`jobs.queue.text.problem` says which), and a statement carrying one fails whole: a
filter, a search, a reason or a command argument holding one would show the operator a server
error or a traceback instead of an answer. The admin and the commands check every value they
take from an operator here first, and answer as fits where it came from:

* a list filter that no stored row can match shows no rows, and says why
  (:func:`first_refusal`, used by :mod:`jobs.admin.inputs`);
* a form field is invalid, with the reason (:func:`validate_text`, a Django validator);
* a command argument ends the command with a ``CommandError`` naming it
  (:func:`check_arguments`, and :func:`check_limit` for a ``--limit``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.core.exceptions import ValidationError

from jobs.queue.text import problem

#: The largest row count a statement's ``LIMIT`` takes (PostgreSQL's ``bigint``).
LIMIT_MAX = 2**63 - 1


def refusal(value: Any) -> str | None:
    """Why the database could not take ``value`` (text, or a list of texts), or None."""
    if isinstance(value, str):
        return problem(value)
    if isinstance(value, list | tuple):
        return next((why for item in value if (why := refusal(item)) is not None), None)
    return None


def first_refusal(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first ``(name, why)`` among ``values`` the database could not take, or None."""
    for name, value in values.items():
        if (why := refusal(value)) is not None:
            return name, why
    return None


def validate_text(value: Any) -> None:
    """A form field's validator: text the database cannot hold is not a valid value."""
    if (why := refusal(value)) is not None:
        raise ValidationError(f"This value {why}.", code="unstorable")


def check_arguments(options: Mapping[str, Any], positional: Iterable[str] = ()) -> None:
    """Raise ValueError naming the first command argument the database could not take.

    ``options`` is a command's parsed options; an option is named as typed (``--job-type``),
    the ``positional`` arguments by their name.
    """
    if (found := first_refusal(options)) is not None:
        name, why = found
        shown = name if name in set(positional) else "--" + name.replace("_", "-")
        raise ValueError(f"{shown} {why}")


def check_limit(limit: int) -> None:
    """Raise ValueError for a ``--limit`` no statement can take: below 1, or beyond ``bigint``."""
    if limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if limit > LIMIT_MAX:
        raise ValueError(f"--limit must be at most {LIMIT_MAX}, got {limit}")
