"""``manage.py replay``: the admin's replay for scripts, under the same rules.

The user named by ``--user`` must be active staff holding the table's replay and view
permissions, as in the admin (replay shows the rows it acts on); the eligible rows are
replayed in the table's own way and each gets a ``LogEntry`` under that user, exactly as
from the failure monitor. Rows are chosen by id (a value that is not one of the table's ids
is an error, not a row skipped), or by filters (``--all``), at most ``--limit`` (1 or more).
An argument the database could not take (a NUL character) is an error naming it.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.control import (
    AGES,
    REPLAY_ALL_LIMIT,
    Filters,
    denial,
    eligible_rows,
    replay,
    run_tables,
    summary,
)
from jobs.control.inputs import check_arguments, check_limit
from jobs.control.operators import staff_user
from jobs.control.replays import parse_ids
from jobs.runs import RunState


class Command(BaseCommand):
    help = "Replay failed rows of the jobs table or of a run table, as a named user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ids", nargs="*", help="primary keys of the rows to replay")
        parser.add_argument("--user", required=True, help="who replays (needs the permission)")
        parser.add_argument(
            "--model", default="jobs.job", help="run table label, e.g. mail.delivery"
        )
        parser.add_argument(
            "--all", action="store_true", help="replay every eligible row matching the filters"
        )
        parser.add_argument("--job-type", default="", help="only rows of this job type")
        parser.add_argument("--tenant", default="", help="only rows of this tenant")
        parser.add_argument("--error", default="", help="only rows with this last_error code")
        parser.add_argument("--age", choices=sorted(AGES), help="only rows failed this recently")
        parser.add_argument("--job-id", default="", help="only rows whose job_id contains this")
        parser.add_argument(
            "--limit",
            type=int,
            default=REPLAY_ALL_LIMIT,
            help=f"at most this many rows with --all (default {REPLAY_ALL_LIMIT})",
        )
        parser.add_argument("--dry-run", action="store_true", help="list, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            check_arguments(options, positional=("ids",))
            check_limit(options["limit"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        user = self._user(options["user"])
        tables = {table.label: table for table in run_tables()}
        table = tables.get(options["model"])
        if table is None:
            raise CommandError(
                f"no run table {options['model']!r}; choose from {', '.join(sorted(tables))}"
            )
        if not table.can_replay(user):
            raise CommandError(f"user {user.get_username()!r}: {denial(user, table)}")
        if bool(options["ids"]) == options["all"]:
            raise CommandError("give either row ids or --all with filters, not both or neither")
        if options["all"]:
            filters = Filters(
                module=table.label,
                state=RunState.FAILED,
                job_type=options["job_type"],
                tenant=options["tenant"],
                error=options["error"],
                age=AGES[options["age"]][0] if options["age"] else None,
                q=options["job_id"],
            )
            rows, matching, _capped = eligible_rows([table], filters, options["limit"])
            pks = [row.pk for row in rows]
            self.stdout.write(f"{matching} eligible rows match; taking {len(pks)}.")
        else:
            try:
                pks = parse_ids(table, options["ids"])
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        if options["dry_run"]:
            eligible = table.eligible_pks(pks)
            self.stdout.write(
                f"Would replay {len(eligible)} {table.label} rows "
                f"({table.replay_description}): {' '.join(map(str, eligible)) or '-'}"
            )
            return
        results = replay(user, {table: pks}, via="manage.py replay")
        self.stdout.write(summary(results))
        replayed = results[0].replayed if results else ()
        if replayed:
            self.stdout.write(f"Replayed ids: {' '.join(map(str, replayed))}")

    def _user(self, username: str) -> Any:
        try:
            return staff_user(username)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
