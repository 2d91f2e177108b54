"""Settings for the test suite: the project's, plus apps installed only for tests."""

import copy
import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS, JOBS

# jobapp: job types discovered from an app's jobs.py; procapp: job types that the acceptance
# tests run in real worker processes.
INSTALLED_APPS = [*INSTALLED_APPS, "tests.jobapp", "tests.procapp", "tests.runapp"]

# Acceptance tests shorten the lease of the worker processes they start (seconds).
if lease := os.environ.get("TEST_JOBS_LEASE"):
    JOBS = {**JOBS, "LEASE": float(lease)}
# ... and how long a call on a silent network path may hang (the many-hosts test cuts links).
if network_timeout := os.environ.get("TEST_JOBS_NETWORK_TIMEOUT"):
    JOBS = {**JOBS, "DB_NETWORK_TIMEOUT": float(network_timeout)}
# ... and how long the rows of gone processes are kept before the retention pass deletes them.
if process_retention := os.environ.get("TEST_JOBS_PROCESS_RETENTION"):
    JOBS = {**JOBS, "PROCESS_RETENTION": float(process_retention)}

# A test database per test run, so several runs can share one PostgreSQL server at once.
DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}"}

# A second database alias for the several-databases tests. Until tests/support/otherdb.py points it
# at a second PostgreSQL server (before the test databases are made, and only when a collected test
# asks for "other"), it is a second database on the default server. pytest-django creates it and
# lets a test open it only where the test asks, so the rest of the suite never does.
DATABASES["other"] = {
    **copy.deepcopy(DATABASES["default"]),
    "TEST": {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}_other"},
}
