"""Runtime settings of one worker process, validated before the worker starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from jobs.core.conf import jobs_settings
from jobs.queue.types import AllTenantsExcept, OnlyTenant, Scope
from jobs.runtime.process import process_identity

#: The component name base workers use for tenant overrides unless told otherwise.
DEFAULT_COMPONENT = "worker"


def default_identity() -> str:
    """``host:pid:nonce``: this process's ``claimed_by`` and the key of its processes row."""
    return process_identity()


#: Handler threads of a worker without ``--concurrency``. A thread costs a database connection
#: only once its handler touches the database, and the pool wakes no more threads than its
#: jobs need, so short jobs run on a few whatever the number; jobs that wait on the network
#: (mail, HTTP calls), the common case, run as many at once as there are threads. 20 takes a
#: worker of no-op jobs past one claim per 10 jobs (docs/worker.md, "Concurrency").
DEFAULT_CONCURRENCY = 20


@dataclass(frozen=True)
class WorkerConfig:
    """How one worker process runs. Every field has a default; see the README's table."""

    scope: Scope = field(default_factory=lambda: AllTenantsExcept(DEFAULT_COMPONENT))
    # The database alias whose jobs this worker runs (jobs.catalogue.routing): every statement of
    # the worker's own goes there, and its handlers' contexts say so (``ctx.using``).
    database: str = field(default_factory=lambda: str(jobs_settings.DATABASE))
    concurrency: int = DEFAULT_CONCURRENCY
    # Jobs held beyond the handler threads, waiting for the next free one, so a thread that
    # finishes starts another without waiting for a claim; only while handlers run short (see
    # handoff.PREFETCH_HORIZON). Off by default: a worker claims at most its free slots.
    prefetch: int = 0
    shutdown_timeout: float = 30.0
    # After the shutdown timeout: how long cancelled handlers get to return before exit.
    cancel_timeout: float = 5.0
    poll_interval: float = 0.5
    ack_interval: float = 0.005
    maintenance_interval: float = 15.0
    # Expired leases are looked for this often, so a dead worker's jobs come back within
    # lease + this interval (the query reads only running rows).
    recovery_interval: float = 1.0
    # After a database error the loop waits poll_interval, doubling per failure, up to this.
    error_backoff_max: float = 10.0
    maintenance_limit: int = 100
    lease: timedelta | None = None
    listen: bool | None = None
    identity: str = field(default_factory=default_identity)
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    install_signal_handlers: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.concurrency <= 1000:
            problems.append(f"concurrency must be from 1 to 1000, got {self.concurrency}")
        if not 0 <= self.prefetch <= 10000:
            problems.append(f"prefetch must be from 0 to 10000, got {self.prefetch}")
        if self.shutdown_timeout <= 0:
            problems.append(f"shutdown timeout must be positive, got {self.shutdown_timeout}")
        if self.cancel_timeout < 0:
            problems.append(f"cancel timeout must not be negative, got {self.cancel_timeout}")
        if self.recovery_interval <= 0:
            problems.append(f"recovery interval must be positive, got {self.recovery_interval}")
        if self.error_backoff_max <= 0:
            problems.append(f"error backoff must be positive, got {self.error_backoff_max}")
        if self.poll_interval <= 0:
            problems.append(f"poll interval must be positive, got {self.poll_interval}")
        if self.maintenance_interval <= 0:
            problems.append(
                f"maintenance interval must be positive, got {self.maintenance_interval}"
            )
        if self.ack_interval < 0:
            problems.append(f"ack interval must not be negative, got {self.ack_interval}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            problems.append(f"HTTP port must be from 0 to 65535, got {self.http_port}")
        if self.database not in settings.DATABASES:
            problems.append(
                f"database must be an alias of settings.DATABASES "
                f"({', '.join(settings.DATABASES)}), got {self.database!r}"
            )
        if not isinstance(self.scope, Scope):
            problems.append(f"scope must be a jobs.queue Scope, got {self.scope!r}")
        if problems:
            raise ImproperlyConfigured("invalid worker configuration: " + "; ".join(problems))

    @property
    def lease_duration(self) -> timedelta:
        return self.lease or jobs_settings.LEASE

    @property
    def notify_enabled(self) -> bool:
        return jobs_settings.NOTIFY if self.listen is None else self.listen


def scope_from(tenant: str | None, component: str | None) -> Scope:
    """``--tenant`` makes a branch worker; otherwise a base worker of ``component``."""
    try:
        if tenant:
            return OnlyTenant(tenant)
        return AllTenantsExcept(component or DEFAULT_COMPONENT)
    except ValueError as exc:
        raise ImproperlyConfigured(f"invalid worker scope: {exc}") from None


def env_scope(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """WORKER_BRANCH and WORKER_COMPONENT from the environment (empty means unset)."""
    environ = os.environ if environ is None else environ
    return environ.get("WORKER_BRANCH") or None, environ.get("WORKER_COMPONENT") or None
