"""The jobs table's storage settings and statistics (migration 0001), and their reverse."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection

from jobs import queue

pytestmark = pytest.mark.django_db

storage = importlib.import_module("jobs.migrations.0001_initial")


def reloptions() -> dict[str, str]:
    with connection.cursor() as cur:
        cur.execute("SELECT reloptions FROM pg_class WHERE oid = 'jobs_job'::regclass")
        (options,) = cur.fetchone()
    return dict(option.split("=", 1) for option in options or [])


def statistics() -> list[tuple[str, list[str]]]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT stxname, stxkind::text[] FROM pg_statistic_ext "
            "WHERE stxrelid = 'jobs_job'::regclass ORDER BY stxname"
        )
        return [(name, list(kinds)) for name, kinds in cur.fetchall()]


def test_the_migration_sets_every_storage_parameter():
    assert reloptions() == {key: str(value) for key, value in storage.SETTINGS.items()}
    assert statistics() == [("jobs_job_state_name", ["m"])]


def test_the_reverse_resets_every_storage_parameter():
    with connection.cursor() as cur:
        cur.execute(storage.STATISTICS_DROP)
        cur.execute(storage.STORAGE_RESET)

    assert reloptions() == {}
    assert statistics() == []


INSERT = """
INSERT INTO jobs_job (job_id, name, payload, tenant, queue, priority, max_attempts, run_after,
                      state, attempts, last_error, error_detail, claimed_by, key_held,
                      replayed_by, created_at, finished_at)
SELECT %(name)s || %(state)s || g, %(name)s, '{}', 'default', 'default', 0, 5, now(),
       %(state)s, 0, '', '', '', %(state)s = 'queued', '', now(),
       CASE WHEN %(state)s = 'queued' THEN NULL ELSE now() END
FROM generate_series(1, %(count)s) AS g
"""


def test_the_state_and_name_statistics_keep_the_backlog_estimate_close():
    """Where one type dominates the finished rows and another is all queued, assuming state
    and name independent puts the estimate off by half; the MCV statistics know better."""
    with connection.cursor() as cur:
        for name, state, count in [
            ("busy.v1", "queued", 3000),
            ("busy.v1", "succeeded", 2000),
            ("other.v1", "succeeded", 20000),
            ("late.v1", "queued", 15000),
        ]:
            cur.execute(INSERT, {"name": name, "state": state, "count": count})
        cur.execute("ANALYZE jobs_job")

    rows = {row.name: row for row in queue.backlog(cap=1000)}

    for name, actual in [("busy.v1", 3000), ("late.v1", 15000)]:
        assert not rows[name].queued_exact
        assert abs(rows[name].queued - actual) <= actual * 0.1, (name, rows[name].queued)
