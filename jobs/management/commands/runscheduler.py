"""``manage.py runscheduler``: cron, watchdog, retention, archive; one leader, many standbys."""

from __future__ import annotations

import os
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.catalogue.registry import get_registry
from jobs.catalogue.schedules import load_schedules
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.runner import Scheduler

#: Exit status of ``--once`` when another scheduler leads and this one did nothing.
STOOD_BY = 3


def _env_port(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise CommandError(f"{name} must be a port number, got {raw!r}") from None


class Command(BaseCommand):
    help = (
        "Run the scheduler: fire cron schedules, reap stale runs, prune old rows. Run one or "
        "more; one leads (a PostgreSQL advisory lock) and the others stand by. Stops on "
        "SIGTERM/SIGINT and hands leadership over."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help=(
                "Try once to lead; if leading, run every duty once, then exit. Exit status: "
                f"0 led and every duty ran, {STOOD_BY} stood by (another scheduler leads, "
                "nothing was done), 1 an error (a duty failed, or no database)."
            ),
        )
        parser.add_argument(
            "--tick-interval",
            type=float,
            default=1.0,
            help="Seconds between cron ticks while leading (default 1).",
        )
        parser.add_argument(
            "--standby-interval",
            type=float,
            default=1.0,
            help="Seconds between leadership attempts while standing by (default 1).",
        )
        parser.add_argument(
            "--watchdog-interval",
            type=float,
            default=30.0,
            help="Seconds between watchdog passes over the run tables (default 30).",
        )
        parser.add_argument(
            "--retention-interval",
            type=float,
            default=600.0,
            help="Seconds between retention passes (default 600).",
        )
        parser.add_argument(
            "--archive-interval",
            type=float,
            default=5.0,
            help="Seconds between archive passes moving finished jobs to history (default 5).",
        )
        parser.add_argument(
            "--gauge-interval",
            type=float,
            default=15.0,
            help="Seconds between refreshes of the backlog and table-health gauges, which only "
            "the leader exports (default 15).",
        )
        parser.add_argument(
            "--http-port",
            type=int,
            default=_env_port("SCHEDULER_HTTP_PORT"),
            help="Serve /healthz, /readyz and /metrics on this port (off by default).",
        )
        parser.add_argument(
            "--http-host",
            default=os.environ.get("SCHEDULER_HTTP_HOST", "127.0.0.1"),
            help="Interface for the HTTP listener (default 127.0.0.1).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            config = SchedulerConfig(
                tick_interval=options["tick_interval"],
                standby_interval=options["standby_interval"],
                watchdog_interval=options["watchdog_interval"],
                retention_interval=options["retention_interval"],
                archive_interval=options["archive_interval"],
                gauge_interval=options["gauge_interval"],
                http_host=options["http_host"],
                http_port=options["http_port"],
            )
            scheduler = Scheduler(config, schedules=load_schedules(), registry=get_registry())
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        if not options["once"]:
            scheduler.run()
            return
        report = scheduler.run_once()
        if not report.reachable:
            raise CommandError("could not reach the database to contend for leadership")
        if not report.led:
            raise CommandError(
                "stood by: another scheduler leads; nothing was done", returncode=STOOD_BY
            )
        if report.failed:
            raise CommandError(
                f"led, but {', '.join(report.failed)} failed (see the log); "
                f"ran {', '.join(report.ran) or 'nothing else'}"
            )
        self.stdout.write(f"led: ran {', '.join(report.ran)}")
