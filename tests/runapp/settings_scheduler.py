"""Test settings plus a schedule that fires every second, for real ``runscheduler`` processes.

Start them with ``manage.py runscheduler --settings tests.runapp.settings_scheduler``.
"""

from tests.settings import *  # noqa: F403
from tests.settings import JOBS

JOBS = {
    **JOBS,
    "SCHEDULES": {
        "every-second": {
            "cron": "* * * * * *",
            "job": "jobapp.ping.v1",
            "payload": {"message": "tick"},
            "misfire": "all",
            "grace": 5,  # a leader back within five seconds fires what it missed on time
        },
    },
    # A stalled leader loses its session (and leadership) after two seconds.
    "SCHEDULER_LEADER_TIMEOUT": 2,
    # Below the leader timeout, as jobs.W022 asks.
    "DB_STATEMENT_TIMEOUT": 1,
    "DB_LOCK_TIMEOUT": 0.5,
}
