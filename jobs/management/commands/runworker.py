"""``manage.py runworker``: run a worker process until SIGTERM/SIGINT."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.catalogue import routing as databases
from jobs.catalogue.registry import get_registry
from jobs.core.conf import jobs_settings
from jobs.worker.config import DEFAULT_CONCURRENCY, WorkerConfig, env_scope, scope_from
from jobs.worker.runner import Worker


def _env_number[T](name: str, kind: Callable[[str], T], default: T) -> T:
    raw = os.environ.get(name)
    if not raw:  # unset or empty
        return default
    try:
        return kind(raw)
    except ValueError:
        raise CommandError(f"{name} must be a number, got {raw!r}") from None


class Command(BaseCommand):
    help = (
        "Run a background job worker. Claims, in its database, jobs of every registered type "
        "that lives there, in its tenant scope; drains gracefully on SIGTERM/SIGINT (a second "
        "signal stops at once)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        branch, component = env_scope()
        parser.add_argument(
            "--database",
            default=os.environ.get("WORKER_DATABASE") or jobs_settings.DATABASE,
            help="Database alias whose jobs to run: the job types bound to it and every unbound "
            "type (env WORKER_DATABASE; default JOBS['DATABASE'], itself 'default').",
        )
        parser.add_argument(
            "--tenant",
            default=branch,
            help="Branch worker: run only this tenant's jobs (env WORKER_BRANCH).",
        )
        parser.add_argument(
            "--component",
            default=component,
            help="Component name matched against tenant overrides (env WORKER_COMPONENT; "
            "default 'worker').",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=_env_number("WORKER_CONCURRENCY", int, DEFAULT_CONCURRENCY),
            help=(
                "Handler threads, i.e. jobs run at once (env WORKER_CONCURRENCY; "
                f"default {DEFAULT_CONCURRENCY})."
            ),
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=_env_number("WORKER_PREFETCH", int, 0),
            help="Jobs held beyond the slots while handlers run short, so a handler that ends "
            "starts the next at once; for many very short jobs, or handlers that wait on I/O "
            "(env WORKER_PREFETCH; default 0: the worker claims at most its free slots).",
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=float,
            default=_env_number("WORKER_SHUTDOWN_TIMEOUT", float, 30.0),
            help="Seconds to let running jobs finish on SIGTERM (default 30).",
        )
        parser.add_argument(
            "--cancel-timeout",
            type=float,
            default=_env_number("WORKER_CANCEL_TIMEOUT", float, 5.0),
            help="After the shutdown timeout, seconds to wait for cancelled handlers to return "
            "before exiting; jobs still running then keep their leases (env "
            "WORKER_CANCEL_TIMEOUT; default 5).",
        )
        parser.add_argument(
            "--poll-interval",
            type=float,
            default=0.5,
            help="Seconds between claims when no NOTIFY arrives (default 0.5).",
        )
        parser.add_argument(
            "--maintenance-interval",
            type=float,
            default=15.0,
            help="Seconds between passes that fail jobs with no attempts left (default 15). "
            "Expired leases are recovered every second regardless.",
        )
        parser.add_argument(
            "--http-port",
            type=int,
            default=_env_number("WORKER_HTTP_PORT", int, None),
            help="Serve /healthz, /readyz and /metrics on this port (off by default).",
        )
        parser.add_argument(
            "--http-host",
            default=os.environ.get("WORKER_HTTP_HOST", "127.0.0.1"),
            help="Interface for the HTTP listener (default 127.0.0.1).",
        )
        parser.add_argument(
            "--no-listen",
            action="store_true",
            help="Do not LISTEN for new work (behind transaction-mode poolers); poll only.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["tenant"] and options["component"]:
            raise CommandError("give either --tenant (branch worker) or --component, not both")
        try:
            config = WorkerConfig(
                scope=scope_from(options["tenant"], options["component"]),
                database=options["database"],
                concurrency=options["concurrency"],
                prefetch=options["prefetch"],
                shutdown_timeout=options["shutdown_timeout"],
                cancel_timeout=options["cancel_timeout"],
                poll_interval=options["poll_interval"],
                maintenance_interval=options["maintenance_interval"],
                http_host=options["http_host"],
                http_port=options["http_port"],
                listen=False if options["no_listen"] else None,
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        if problems := databases.problems(config.database):
            raise CommandError(f"cannot run this worker: {problems[0]}")
        pooled = databases.behind_a_pooler(config.database)
        if pooled and "jobs.W030" not in settings.SILENCED_SYSTEM_CHECKS:
            # As the system check would, were it asked to read the database (check --database).
            self.stderr.write(f"(jobs.W030) {pooled}\n\tHINT: {databases.POOLER_HINT}")
        Worker(get_registry(), config).run()
