"""Settings for mypy's Django plugin: the test suite's, without starting or reaching a database.

The plugin imports settings and populates the app registry but never connects, so a dummy
``DATABASE_URL`` keeps project/settings.py from starting the embedded PostgreSQL. Port 1
refuses at once, should anything try to connect after all.
"""

import os

os.environ.setdefault("DATABASE_URL", "postgres://typecheck@127.0.0.1:1/typecheck")

from tests.settings import *  # noqa: F403
