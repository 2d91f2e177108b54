"""The scheduler: cron schedules, the watchdog over every run table, retention, one leader.

``manage.py runscheduler`` runs it; any number of replicas may run, one leads. The public API:

* :func:`schedule` declares a schedule in code (``<app>/jobs.py``);
* :func:`status` reports each schedule's last fired slot, next due slot and whether it is
  overdue (for the admin and for health checks);
* :func:`get_schedules` returns the validated schedules.

Names load lazily: importing this package (``jobs.models`` imports its slot vocabulary) pulls
in neither the database layer nor the scheduler's metrics.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Schedule": "jobs.scheduler.schedules",
    "get_schedules": "jobs.scheduler.schedules",
    "load_schedules": "jobs.scheduler.schedules",
    "schedule": "jobs.scheduler.schedules",
    "ScheduleStatus": "jobs.scheduler.reporting",
    "status": "jobs.scheduler.reporting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jobs.scheduler' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
