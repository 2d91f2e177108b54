"""Limits the README states as numbers, checked against the code that enforces them."""

from __future__ import annotations

import inspect
from datetime import timedelta

from jobs import queue
from jobs.admin import ACTION_LIMIT
from jobs.control.replays import REPLAY_ALL_LIMIT
from jobs.testing import run_worker


def test_admin_actions_and_replay_all_change_at_most_500_rows():
    assert ACTION_LIMIT == REPLAY_ALL_LIMIT == 500


def test_retry_delays_stop_at_30_days():
    days = timedelta(days=30)
    assert days == queue.RETRY_DELAY_MAX


def test_run_worker_waits_10_seconds_by_default():
    assert inspect.signature(run_worker).parameters["timeout"].default == 10.0
