"""Test settings with three broken schedules: ``runscheduler`` must refuse to start."""

from tests.settings import *  # noqa: F403
from tests.settings import JOBS

JOBS = {
    **JOBS,
    "SCHEDULES": {
        "bad-cron": {"cron": "61 * * * *", "job": "jobapp.ping.v1", "payload": {"message": "x"}},
        "unknown-job": {"cron": "0 * * * *", "job": "nobody.registers.v1"},
        "bad-payload": {"cron": "0 * * * *", "job": "jobapp.ping.v1", "payload": {"message": 5}},
    },
}
