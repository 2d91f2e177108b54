"""``settings_scheduler`` with database bounds that fit its two-second leader timeout.

``TEST_JOBS_DB_BOUNDS=off`` leaves statements unbounded, so that a duty blocked in the
database stays blocked and only the leader's own stall detection can hand over.
"""

import os

from tests.runapp.settings_scheduler import *  # noqa: F403
from tests.runapp.settings_scheduler import JOBS

if os.environ.get("TEST_JOBS_DB_BOUNDS") == "off":
    JOBS = {**JOBS, "DB_STATEMENT_TIMEOUT": 0, "DB_LOCK_TIMEOUT": 0}
else:
    JOBS = {**JOBS, "DB_STATEMENT_TIMEOUT": 1, "DB_LOCK_TIMEOUT": 0.5}
