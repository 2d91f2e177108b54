"""Runtime settings of one scheduler process, validated before it starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured

from jobs.catalogue.schedules import Schedule
from jobs.core.conf import jobs_settings
from jobs.runtime.process import process_identity
from jobs.scheduler.retention import ArchiveConfig, RetentionConfig
from jobs.scheduler.watchdog import WatchdogConfig

INTERVALS = (
    "tick_interval",
    "standby_interval",
    "watchdog_interval",
    "retention_interval",
    "archive_interval",
    "gauge_interval",
)


def default_identity() -> str:
    """host:pid:nonce, shown in logs, in slot rows and in ``pg_stat_activity.application_name``."""
    return process_identity()


@dataclass(frozen=True)
class SchedulerConfig:
    """How one scheduler process runs. Intervals are in seconds; see docs/scheduler.md."""

    identity: str = field(default_factory=default_identity)
    tick_interval: float = 1.0  # cron ticks while leading
    standby_interval: float = 1.0  # leadership attempts while standing by
    watchdog_interval: float = 30.0
    retention_interval: float = 600.0
    archive_interval: float = 5.0
    gauge_interval: float = 15.0  # backlog and table-health gauges (the leader only)
    leader_timeout: timedelta | None = None  # None: JOBS["SCHEDULER_LEADER_TIMEOUT"]
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    install_signal_handlers: bool = True

    def __post_init__(self) -> None:
        problems = []
        for name in INTERVALS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                problems.append(f"{name.replace('_', ' ')} must be positive, got {value!r}")
        if self.leader_duration < timedelta(seconds=1):
            problems.append(f"leader timeout must be at least 1 second, got {self.leader_duration}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            problems.append(f"HTTP port must be from 0 to 65535, got {self.http_port}")
        if not self.identity:
            problems.append("identity must not be empty")
        if problems:
            raise ImproperlyConfigured("invalid scheduler configuration: " + "; ".join(problems))

    @property
    def leader_duration(self) -> timedelta:
        return self.leader_timeout or jobs_settings.SCHEDULER_LEADER_TIMEOUT

    def check_schedules(self, schedules: Sequence[Schedule]) -> None:
        """A tick interval longer than a schedule's grace would turn its slots into misfires."""
        tick = timedelta(seconds=self.tick_interval)
        slow = [s.name for s in schedules if s.misfire_grace <= tick]
        if slow:
            raise ImproperlyConfigured(
                f"invalid scheduler configuration: the tick interval ({self.tick_interval}s) "
                f"must be shorter than the misfire grace of schedules {', '.join(slow)}"
            )
