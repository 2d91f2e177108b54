"""The scheduler: cron schedules, the watchdog over every run table, retention, one leader.

``manage.py runscheduler`` runs it; any number of replicas may run, one leads. The public API:

* :func:`schedule` declares a schedule in code (``<app>/jobs.py``);
* :func:`status` reports each schedule's last fired slot, next due slot and whether it is
  overdue (for the admin and for health checks);
* :func:`get_schedules` returns the validated schedules.

Declared schedules belong to the catalogue (:mod:`jobs.catalogue.schedules`); they are
re-exported here, where a project looks for them.
"""

from jobs.catalogue.schedules import Schedule, get_schedules, load_schedules, schedule
from jobs.scheduler.reporting import ScheduleStatus, status

__all__ = ["Schedule", "ScheduleStatus", "get_schedules", "load_schedules", "schedule", "status"]
