"""Settings of the benchmark processes: the project's, with the benchmark job types.

Worker processes started by the benchmarks run with ``DJANGO_SETTINGS_MODULE=bench.settings``
and the bench ``DATABASE_URL`` (``<db>_bench``, see ``bench/_setup.py``). The project's own
example apps (``project.*``) are left out, so that a worker registers only the benchmark's
job types and every claim asks for those alone.

Measurement-only knobs, for experiments (unset by default):

- ``BENCH_CONN_MAX_AGE`` (seconds, or ``none`` for unlimited) sets the default database's
  ``CONN_MAX_AGE``, to compare the handler pool's per-job connection handling with
  persistent connections (``bench/drain.py --type touch --conn-max-age 60``);
- ``BENCH_CONN_HEALTH_CHECKS`` (``0`` or ``1``) sets ``CONN_HEALTH_CHECKS`` (the project
  turns them on; with persistent connections Django then runs ``SELECT 1`` before the first
  query after every ``close_old_connections()``, i.e. once per job in the worker);
- ``BENCH_DB_OPTIONS`` (a JSON object) is merged into the default database's ``OPTIONS``,
  e.g. ``{"server_side_binding": true, "prepare_threshold": 2}`` for prepared statements.
"""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES, INSTALLED_APPS

INSTALLED_APPS = [
    *(app for app in INSTALLED_APPS if not app.startswith("project.")),
    "bench.benchapp",
]

if max_age := os.environ.get("BENCH_CONN_MAX_AGE"):
    DATABASES["default"]["CONN_MAX_AGE"] = None if max_age.lower() == "none" else int(max_age)

if checks := os.environ.get("BENCH_CONN_HEALTH_CHECKS"):
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = checks == "1"

if options := os.environ.get("BENCH_DB_OPTIONS"):
    DATABASES["default"]["OPTIONS"] = {
        **DATABASES["default"].get("OPTIONS", {}),
        **json.loads(options),
    }
