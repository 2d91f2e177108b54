"""Test settings for the processes the several-databases tests start.

``TEST_OTHER_DATABASE_URL`` names the ``other`` alias's test database; this app's job types
live there, and a schedule fires one of them every second.
"""

import os
from urllib.parse import unquote

import environ

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, INSTALLED_APPS, JOBS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.dbapp"]
DATABASES["other"] = environ.Env.db_url_config(os.environ["TEST_OTHER_DATABASE_URL"])
DATABASES["other"]["HOST"] = unquote(DATABASES["other"].get("HOST", ""))
JOBS = {
    **JOBS,
    "DATABASES": ["default", "other"],
    "SCHEDULES": {
        "other-every-second": {
            "cron": "* * * * * *",
            "job": "dbapp.report.v1",
            "payload": {"number": 0},
            "misfire": "skip",
        },
    },
}
