"""``manage.py jobs``: the admin's operator controls for scripts, under the same rules.

    manage.py jobs pause job_type|queue|tenant|schedule NAME --user U [--reason TEXT]
    manage.py jobs resume job_type|queue|tenant|schedule NAME --user U
    manage.py jobs paused
    manage.py jobs run-now SCHEDULE --user U
    manage.py jobs cancel ID [ID …] --user U
    manage.py jobs cancel --all [--job-type T] [--tenant T] [--queue Q] [--state S] --user U

``--database ALIAS`` (before the action) acts on the jobs tables of another alias of
``JOBS["DATABASES"]`` (default ``JOBS["DATABASE"]``); schedules and run-now stay with the
schedule's own database.

The user named by ``--user`` must be active staff holding the permission the admin asks for
(``jobs.pause_work``, ``jobs.cancel_job``, ``jobs.run_schedule``); every change gets a
``LogEntry`` under that user, exactly as from the admin. An argument the database could not
take (a NUL character, a lone surrogate) is an error naming it, before anything is read.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.catalogue import routing as databases
from jobs.control import cancels, pauses, schedules
from jobs.control.inputs import check_arguments, check_limit
from jobs.control.operators import staff_user
from jobs.models import PauseKind
from jobs.runs import ACTIVE_STATES

VIA = "manage.py jobs"
#: The arguments given without an option name, as the errors name them.
POSITIONAL = ("action", "kind", "name", "schedule", "ids")


class Command(BaseCommand):
    help = "Pause, resume and cancel work as a named user (the admin's operator controls)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="the alias whose jobs to pause, resume, list or cancel (one of "
            'JOBS["DATABASES"]; default JOBS["DATABASE"])',
        )
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        for name, text in (
            ("pause", "stop claiming a job type, queue or tenant, or firing a schedule"),
            ("resume", "claim a paused job type, queue or tenant again, or fire a schedule"),
        ):
            sub = actions.add_parser(name, help=text, description=text)
            sub.add_argument("kind", choices=PauseKind.values)
            sub.add_argument("name", help="the job type, queue, tenant or schedule")
            sub.add_argument("--user", required=True, help="who does it (needs jobs.pause_work)")
            if name == "pause":
                sub.add_argument("--reason", default="", help="shown on the overview and logged")
        actions.add_parser("paused", help="list what is paused")
        run = actions.add_parser(
            "run-now",
            help="enqueue one extra job of a schedule (not a slot)",
            description="Enqueue one job of the schedule's job type with its payload and tenant, "
            "now; the schedule's slots are unchanged.",
        )
        run.add_argument("schedule", help="the schedule's name")
        run.add_argument("--user", required=True, help="who runs it (needs jobs.run_schedule)")
        cancel = actions.add_parser(
            "cancel",
            help="cancel queued jobs and ask running ones to stop",
            description="Queued jobs end cancelled at once; running ones are asked to stop "
            "and end cancelled at their worker's next lease renewal.",
        )
        cancel.add_argument("ids", nargs="*", type=int, help="ids of the jobs to cancel")
        cancel.add_argument("--user", required=True, help="who cancels (needs jobs.cancel_job)")
        cancel.add_argument("--all", action="store_true", help="every active job matching")
        cancel.add_argument("--job-type", default="", help="only jobs of this type")
        cancel.add_argument("--tenant", default="", help="only jobs of this tenant")
        cancel.add_argument("--queue", default="", help="only jobs in this queue")
        cancel.add_argument("--state", choices=ACTIVE_STATES, default="", help="only this state")
        cancel.add_argument(
            "--limit",
            type=int,
            default=cancels.CANCEL_ALL_LIMIT,
            help=f"at most this many jobs with --all (default {cancels.CANCEL_ALL_LIMIT})",
        )
        cancel.add_argument("--dry-run", action="store_true", help="list, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            check_arguments(options, positional=POSITIONAL)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        options["database"] = _alias(options["database"])
        try:
            getattr(self, f"_{options['action'].replace('-', '_')}")(options)
        except PermissionDenied as exc:
            raise CommandError(f"user {options['user']!r}: {exc}") from None
        except ValueError as exc:
            raise CommandError(str(exc)) from None

    def _pause(self, options: dict[str, Any]) -> None:
        user = _staff(options["user"])
        kind, name = options["kind"], options["name"]
        using = options["database"]
        if pauses.pause(user, kind, name, reason=options["reason"], via=VIA, using=using):
            self.stdout.write(f"Paused {kind} {name}.")
        else:
            self.stdout.write(f"{kind} {name} was paused already; nothing changed.")

    def _resume(self, options: dict[str, Any]) -> None:
        user = _staff(options["user"])
        kind, name = options["kind"], options["name"]
        if pauses.resume(user, kind, name, via=VIA, using=options["database"]):
            self.stdout.write(f"Resumed {kind} {name}.")
        else:
            self.stdout.write(f"{kind} {name} was not paused; nothing changed.")

    def _paused(self, options: dict[str, Any]) -> None:
        from jobs import queue

        rows = queue.paused(using=options["database"])
        for row in rows:
            reason = f" ({row.reason})" if row.reason else ""
            self.stdout.write(
                f"{row.kind:<9} {row.value}  since {row.paused_at:%Y-%m-%d %H:%M:%S %Z} "
                f"by {row.paused_by or '?'}{reason}"
            )
        if not rows:
            self.stdout.write("Nothing is paused.")

    def _run_now(self, options: dict[str, Any]) -> None:
        user = _staff(options["user"])
        done = schedules.run_now(user, options["schedule"], token=schedules.new_token(), via=VIA)
        self.stdout.write(f"Enqueued job {done.job} ({done.job_id}) of schedule {done.schedule}.")

    def _cancel(self, options: dict[str, Any]) -> None:
        user = _staff(options["user"])
        if bool(options["ids"]) == options["all"]:
            raise CommandError("give either job ids or --all with filters, not both or neither")
        check_limit(options["limit"])
        if options["all"]:
            rows = cancels.matching(
                job_type=options["job_type"],
                tenant=options["tenant"],
                queue_name=options["queue"],
                state=options["state"],
                using=options["database"],
            )
            ids = list(rows.values_list("pk", flat=True)[: options["limit"]])
            self.stdout.write(f"{rows.count()} active jobs match; taking {len(ids)}.")
        else:
            ids = options["ids"]
        if options["dry_run"]:
            self.stdout.write(f"Would cancel: {' '.join(map(str, ids)) or '-'}")
            return
        result = cancels.cancel(user, ids, via=VIA, using=options["database"])
        self.stdout.write(result.summary())


def _staff(username: str) -> Any:
    try:
        return staff_user(username)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _alias(given: str | None) -> str:
    """``--database``, checked against the aliases that hold jobs; the home one when absent."""
    if given is None:
        return databases.home()
    known = databases.configured()
    if given not in known:
        raise CommandError(
            f"--database {given!r} holds no jobs here: use one of {', '.join(known)} "
            '(JOBS["DATABASES"])'
        )
    return given
