"""``bench/scale.py --quick`` end to end: every table state is built, measured and printed.

The script runs as its README says, on a scratch database of its own next to the test
database (``<base>_bench``, which it creates and migrates), with real worker processes; both
databases are dropped afterwards. Only that it runs is checked, not its figures: a test run
shares the machine with everything else.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from django.db import connection

# once: the same on every Django version, so scripts/test runs it in the first leg only.
pytestmark = [pytest.mark.acceptance, pytest.mark.slow, pytest.mark.once]

ROOT = Path(__file__).resolve().parents[2]
#: The state rows of a quick run (sizes divided as ``Sizes.quick`` does).
QUICK_STATES = [
    "empty",
    "1 k queued",
    "10 k queued",
    "10 k future-dated",
    "100 k finished",
    "right after draining 10 k",
]


@pytest.fixture
def bench_database(django_db_blocker) -> Iterator[str]:
    """The URL of a new, empty database on the test server; it and the ``_bench`` database
    the script derives from it are dropped afterwards."""
    name = f"test_scale_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with django_db_blocker.unblock(), connection._nodb_cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    params = connection.settings_dict
    host = quote(params["HOST"] or "localhost", safe="")
    password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
    yield f"postgres://{quote(params['USER'])}{password}@{host}:{params['PORT'] or 5432}/{name}"
    with django_db_blocker.unblock(), connection._nodb_cursor() as cur:
        for database in (f"{name}_bench", name):
            cur.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def first_table(output: str) -> list[str]:
    """The rows of the first table the script prints (after its header and rule)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("state "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append(line.strip())
    return rows


def test_quick_run_builds_measures_and_prints_every_state(bench_database):
    env = {**os.environ, "DATABASE_URL": bench_database, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = [re.split(r"\s{2,}", row) for row in first_table(done.stdout)]
    assert [cells[0] for cells in rows] == QUICK_STATES, done.stdout
    assert all(len(cells) == 13 for cells in rows), done.stdout
    assert "targets against 1 k queued" in done.stdout
