"""Replay rows of any run table in their own domain's way, checked and recorded.

The admin (per-row button, bulk action, "all matching") and ``manage.py replay`` both come
here. For each table: check the replay permission, keep the rows the table calls eligible,
replay them once in the table's own way (``Model.replay(pks, by=username)``; the jobs tables
through :func:`jobs.queue.replay`), and write one ``LogEntry`` per replayed row, all in one
transaction. Replays are conditional updates in each domain, so a double click or two
operators at once replay a row once; only the request that replayed it records it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from jobs.control.tables import Operator, RunTable

REPLAY_ALL_LIMIT = 500  # rows one "replay all matching" may replay; narrow the filter for more

type Targets = dict[RunTable, list[Any]]


@dataclass(frozen=True)
class Replayed:
    """What one table's replay did: rows asked for, rows eligible, rows actually replayed."""

    table: RunTable
    asked: int
    eligible: int
    replayed: tuple[Any, ...]

    @property
    def skipped(self) -> int:
        return self.asked - len(self.replayed)


def parse_tokens(tokens: Iterable[str], tables: Sequence[RunTable]) -> Targets:
    """``["mail.delivery:4", "jobs.job:9"]`` → rows per table; unknown or malformed are dropped."""
    by_label = {table.label: table for table in tables}
    targets: Targets = {}
    for token in tokens:
        for part in token.replace(",", " ").split():
            label, _sep, raw = part.rpartition(":")
            table = by_label.get(label)
            if table is None:
                continue
            try:
                pk = table.to_pk(raw)
            except ValidationError:
                continue
            if pk is not None and pk not in targets.setdefault(table, []):
                targets[table].append(pk)
    return {table: pks for table, pks in targets.items() if pks}


def parse_ids(table: RunTable, given: Iterable[str]) -> list[Any]:
    """The primary keys of ``table`` named by ``given``, once each, in order.

    Unlike :func:`parse_tokens`, which drops what a crafted form may carry, a caller that
    names rows one by one (``manage.py replay 12 13``) hears about a mistake: ValueError
    naming the first value that is not an id of the table.
    """
    pks: list[Any] = []
    for raw in given:
        try:
            pk = table.to_pk(raw)
        except ValidationError:
            pk = None
        if pk is None:
            raise ValueError(f"{raw!r} is not an id of {table.label}")
        if pk not in pks:
            pks.append(pk)
    return pks


def check_permission(user: Operator, tables: Iterable[RunTable]) -> None:
    """Refuse the whole request if the user may not replay, or not view, any one table."""
    for table in tables:
        if not table.can_replay(user):
            raise PermissionDenied(denial(user, table))


def denial(user: Operator, table: RunTable) -> str:
    """Why ``user`` may not replay ``table``: the permission it lacks."""
    if table.supports_replay and user.has_perm(table.replay_permission):
        missing = table.view_permission  # replay shows the rows, so viewing comes with it
    else:
        missing = table.replay_permission
    return _("You may not replay %(table)s (needs the %(perm)s permission).") % {
        "table": table.label,
        "perm": missing,
    }


def replay(
    user: Operator, targets: Mapping[RunTable, Sequence[Any]], *, via: str
) -> list[Replayed]:
    """Replay the eligible rows among ``targets`` as ``user``; ``via`` names the tool in the log."""
    check_permission(user, targets)
    return [_replay_table(user, table, list(pks), via) for table, pks in targets.items()]


def _replay_table(user: Operator, table: RunTable, pks: list[Any], via: str) -> Replayed:
    with transaction.atomic():
        eligible = table.eligible_pks(pks)
        replayed: list[Any] = []
        if eligible:
            count = table.replay(eligible, by=user.get_username())
            replayed = _which(table, eligible, count)
            if replayed:
                LogEntry.objects.log_actions(
                    user.pk,
                    table.model.replayed_rows(replayed).order_by("pk"),
                    CHANGE,
                    change_message=f"Replayed via {via}: {table.replay_description}",
                )
    return Replayed(table, len(pks), len(eligible), tuple(replayed))


def _which(table: RunTable, eligible: list[Any], count: int) -> list[Any]:
    """Which eligible rows ``replay()`` acted on, given only its count.

    All or none is exact. A partial count (another operator replayed some of the same rows
    at the same moment, or a domain refused some) is resolved by reading which rows are no
    longer eligible, inside the same transaction.
    """
    if count <= 0:
        return []
    if count >= len(eligible):
        return eligible
    still = set(table.eligible_pks(eligible))
    return [pk for pk in eligible if pk not in still]


def summary(results: Sequence[Replayed]) -> str:
    """The operator's message: how many rows were replayed, where, and how many were not."""
    replayed = sum(len(r.replayed) for r in results)
    skipped = sum(r.skipped for r in results)
    parts = ", ".join(f"{len(r.replayed)} {r.table.label}" for r in results if r.replayed)
    message = ngettext("Replayed %(count)d row", "Replayed %(count)d rows", replayed) % {
        "count": replayed
    }
    if parts:
        message += f" ({parts})"
    message += "."
    if skipped:
        message += " " + ngettext(
            "%(count)d row was not replayed: it is no longer eligible (not failed, or "
            "already replayed).",
            "%(count)d rows were not replayed: they are no longer eligible (not failed, or "
            "already replayed).",
            skipped,
        ) % {"count": skipped}
    return message
