"""Real processes over two databases: a worker per alias, one scheduler for both.

The ``other`` alias is a second PostgreSQL server where one can start (tests/support/otherdb.py).
The processes run with ``--settings tests.dbapp.settings``: its types (one bound to ``other``, one
unbound) are registered there, and a schedule fires the bound one every second.
"""

from __future__ import annotations

import signal
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connections

from jobs.models import Job, Process, ScheduleSlot
from jobs.queue import AllTenants, ClaimRequest, NewJob, claim, enqueue_many
from tests.dbapp.types import OTHER, NoteV1, ReportV1
from tests.support import otherdb
from tests.support.polling import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", OTHER]),
    pytest.mark.acceptance,
    pytest.mark.slow,
    pytest.mark.once,
]

SETTINGS = ["--settings", "tests.dbapp.settings"]
BOTH = (OTHER, "default")
FAST = ["--poll-interval", "0.1", "--maintenance-interval", "0.5"]


@pytest.fixture
def start(spawn):
    """``spawn`` with the dbapp settings and the ``other`` alias's test database."""
    settings = connections[OTHER].settings_dict
    other_url = otherdb.url(settings, settings["NAME"])

    def run(*args: str, **env: str):
        return spawn(*args, *SETTINGS, TEST_OTHER_DATABASE_URL=other_url, **env)

    return run


def on(alias: str):
    return Job.objects.using(alias)


def raw(name: str, count: int, start: int = 0) -> list[NewJob]:
    return [NewJob(name, {"number": start + i}) for i in range(count)]


def test_a_worker_per_database_drains_its_own_jobs_and_never_the_others(start):
    # The test process registers neither type: it names the alias itself, as a producer of
    # another service would. 300 reports and 100 notes in "other", 300 notes in "default".
    enqueue_many(raw(ReportV1.job_name, 300), using=OTHER)
    enqueue_many(raw(NoteV1.job_name, 100, start=300), using=OTHER)
    enqueue_many(raw(NoteV1.job_name, 300), using="default")
    # Reports that a producer put in the wrong database: the type lives in "other", so the
    # default database's worker leaves them queued and untouched.
    strays = enqueue_many(raw(ReportV1.job_name, 5, start=1000), using="default")

    there = start("runworker", "--database", OTHER, "--concurrency", "4", *FAST)
    here = start("runworker", "--concurrency", "4", *FAST)

    def drained(alias: str) -> bool:
        unfinished = on(alias).exclude(state="succeeded")
        if alias == "default":
            unfinished = unfinished.exclude(name=ReportV1.job_name)  # the strays stay
        return not unfinished.exists()

    wait_for(lambda: drained(OTHER) and drained("default"), timeout=60, what="both drained")

    assert on(OTHER).filter(state="succeeded").count() == 400
    left = on("default").filter(name=ReportV1.job_name)
    assert sorted(left.values_list("pk", "state", "attempts")) == [
        (stray.id, "queued", 0) for stray in strays
    ]
    ran = on("default").exclude(name=ReportV1.job_name)
    results = {OTHER: list(on(OTHER).values_list("result", flat=True))}
    results["default"] = list(ran.values_list("result", flat=True))
    # Every job ran once, in the worker of its database, which told the handler its alias.
    assert {a: Counter(r["pid"] for r in rs) for a, rs in results.items()} == {
        OTHER: {there.pid: 400},
        "default": {here.pid: 300},
    }
    assert {a: {r["using"] for r in rs} for a, rs in results.items()} == {
        OTHER: {OTHER},
        "default": {"default"},
    }
    assert on(OTHER).filter(attempts=1).count() == 400
    # Each worker is listed in the processes table of the database it serves.
    assert [p.pid for p in Process.objects.using(OTHER).filter(component="worker")] == [there.pid]
    assert [p.pid for p in Process.objects.using("default").filter(component="worker")] == [
        here.pid
    ]
    for worker in (there, here):
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=15) == 0
    assert f"database {OTHER}, 4 slots" in there.output()


def test_one_scheduler_recovers_a_lease_and_fires_cron_in_the_other_database(start):
    [report] = enqueue_many(raw(ReportV1.job_name, 1), using=OTHER)
    [held] = claim(
        [ClaimRequest(ReportV1.job_name, 1, 3)],
        scope=AllTenants(),
        limit=1,
        lease=timedelta(milliseconds=1),
        worker="gone:1:dead",  # a worker killed mid-job: nothing renews its lease
        using=OTHER,
    )
    assert held.id == report.id

    scheduler = start("runscheduler", "--watchdog-interval", "0.2", "--tick-interval", "0.2")

    wait_for(
        lambda: on(OTHER).filter(pk=report.id, state="queued").exists(),
        timeout=20,
        what="the watchdog requeued the expired lease in 'other'",
    )
    wait_for(
        lambda: ScheduleSlot.objects.using(OTHER).filter(schedule="other-every-second").exists(),
        timeout=20,
        what="a cron slot recorded in 'other'",
    )
    slot = ScheduleSlot.objects.using(OTHER).filter(schedule="other-every-second").first()
    assert on(OTHER).filter(pk=slot.job_pk, name=ReportV1.job_name, job_id=slot.job_id).exists()
    # The slot lives with its job, not in the home database (where the demo's schedule is).
    assert not ScheduleSlot.objects.using("default").filter(schedule="other-every-second").exists()
    # Leadership and the scheduler's row are the home database's.
    wait_for(
        lambda: Process.objects.using("default").filter(component="scheduler", leader=True),
        timeout=10,
        what="the leader's row in the home database",
    )
    assert not Process.objects.using(OTHER).filter(component="scheduler").exists()
    scheduler.signal(signal.SIGTERM)
    assert scheduler.wait(timeout=15) == 0
    assert "requeued (lease expired) 1 rows of jobs.job" in scheduler.output()
