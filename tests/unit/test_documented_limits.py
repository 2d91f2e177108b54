"""Limits the README states as numbers, checked against the code that enforces them."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from pathlib import Path

from jobs import queue
from jobs.admin.actions import ACTION_LIMIT
from jobs.control.replays import REPLAY_ALL_LIMIT
from jobs.core.conf import DEFAULTS
from jobs.testing import run_worker
from tests.support.pgbouncer import SERVER_LOGIN_RETRY


def test_admin_actions_and_replay_all_change_at_most_500_rows():
    assert ACTION_LIMIT == REPLAY_ALL_LIMIT == 500


def test_retry_delays_stop_at_30_days():
    days = timedelta(days=30)
    assert days == queue.RETRY_DELAY_MAX


def test_run_worker_waits_10_seconds_by_default():
    assert inspect.signature(run_worker).parameters["timeout"].default == 10.0


def _pgbouncer_setup_in_the_docs() -> dict[str, str]:
    """The settings of the PgBouncer set-up that docs/operating-at-scale.md recommends."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operating-at-scale.md").read_text()
    [block] = re.findall(r"```ini\n(\[pgbouncer\]\n.*?)```", text, re.DOTALL)
    pairs = (line.split("=", 1) for line in block.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs if not key.startswith(";")}


def test_pgbouncer_refuses_clients_after_a_database_restart_for_less_than_a_lease():
    """After a failed server login PgBouncer refuses every client for server_login_retry:
    longer than the lease, and running jobs lose their leases before it is over."""
    retry = float(_pgbouncer_setup_in_the_docs()["server_login_retry"])
    # Shorter than the time between two lease renewals: at most one is missed on its account.
    assert timedelta(seconds=retry) < DEFAULTS["LEASE"] / 3
    # The test suite's PgBouncer is the one the docs recommend.
    assert retry == SERVER_LOGIN_RETRY
