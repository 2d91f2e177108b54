"""Several databases: a job type that lives in another alias, end to end in one process.

The ``other`` alias is a second PostgreSQL server (tests/support/otherdb.py; a second database
on the default server where no second server can start). Its job types (tests/dbapp) are put
in the process registry by the ``two_databases`` or ``registry`` fixture only, so no other
test meets them. Beyond the happy path: what a worker, the scheduler, the admin and the
checks do on an alias that is not the home one, and when one of the aliases is gone.
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.tasks import task
from django.test import override_settings

import jobs
from jobs import JobContext, Payload, queue
from jobs.admin.databases import DatabaseFilter
from jobs.catalogue import routing as databases
from jobs.catalogue.registry import JobType, Policy, Rate, Registry, catalogue, get_registry
from jobs.catalogue.routing import check_databases
from jobs.catalogue.schedules import load_schedules
from jobs.db.clock import database_now
from jobs.errors import RetryAfter
from jobs.models import Job, JobHistory, Pause, Rollup, ScheduleSlot
from jobs.queue import AllTenants, ClaimRequest, InvalidJob, NewJob
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.per_database import Outages
from jobs.scheduler.runner import Scheduler
from jobs.testing import run_worker
from tests.dbapp.types import OTHER, NoteV1, ReportV1, job_types
from tests.runapp.models import QuickRun
from tests.support import otherdb
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", OTHER])

BOTH = ["default", OTHER]


@pytest.fixture
def two_databases(monkeypatch, settings):
    """The dbapp types registered in this process, and both aliases configured for jobs."""
    registry = Registry([*get_registry(), *job_types()])
    monkeypatch.setattr(catalogue, "_registry", registry)
    settings.JOBS = {**settings.JOBS, "DATABASES": BOTH}
    return registry


def on(alias: str):
    return Job.objects.using(alias)


def test_the_other_alias_is_a_server_of_its_own_where_one_can_start():
    """Not a mirror of the default database: rows written on one are not on the other."""
    if not otherdb.SEPARATE_SERVER:
        pytest.skip("no second PostgreSQL server could start: a second database stands in")
    ports = []
    for alias in BOTH:
        with connections[alias].cursor() as cur:
            cur.execute("SELECT current_setting('unix_socket_directories'), inet_server_port()")
            ports.append(cur.fetchone())
        assert connections[alias].settings_dict["NAME"].startswith("test_")
    assert ports[0] != ports[1]  # two postmasters, each on its own socket directory


# Enqueue routes by type ----------------------------------------------------------------------


def test_a_bound_type_is_enqueued_in_its_database_and_an_unbound_one_in_the_home_one(
    two_databases,
):
    report = jobs.enqueue(ReportV1(number=1))
    note = jobs.enqueue(NoteV1(number=2))
    elsewhere = jobs.enqueue(NoteV1(number=3), using=OTHER)

    assert list(on(OTHER).values_list("pk", "name")) == sorted(
        [(report.id, ReportV1.job_name), (elsewhere.id, NoteV1.job_name)]
    )
    assert list(on("default").values_list("pk", "name")) == [(note.id, NoteV1.job_name)]
    assert databases.configured() == ("default", OTHER)


def test_a_bound_type_elsewhere_and_a_batch_over_two_databases_are_refused(two_databases):
    with pytest.raises(InvalidJob, match=r"lives in database 'other'.*cannot be enqueued in "):
        jobs.enqueue(ReportV1(number=1), using="default")
    with pytest.raises(InvalidJob, match=r"job #0 \(dbapp.note.v1\) to 'default'; job #1"):
        jobs.enqueue_many([NoteV1(number=1), ReportV1(number=2)])
    with pytest.raises(InvalidJob, match="lives in database 'other'"):  # in a batch too
        jobs.enqueue_many([ReportV1(number=3)], using="default")
    assert not on("default").exists() and not on(OTHER).exists()

    # With using=, an unbound type goes along with the bound one.
    both = jobs.enqueue_many([NoteV1(number=1), ReportV1(number=2)], using=OTHER)
    assert {job.id for job in both} == set(on(OTHER).values_list("pk", flat=True))


def test_a_large_batch_is_refused_whole_for_an_invalid_job_or_its_database(two_databases):
    """Which error a batch reports does not depend on the path that inserts it (by COPY
    from COPY_AT_LEAST keyless jobs on): the producer refuses a batch for the wrong database
    before the queue sees it, and the queue refuses an invalid job on either path."""
    from jobs.queue.enqueue import COPY_AT_LEAST

    jobs_ = [NewJob(ReportV1.job_name, {"number": n}) for n in range(COPY_AT_LEAST)]
    jobs_[5] = NewJob(ReportV1.job_name, {"number": 5}, priority="high")
    with pytest.raises(InvalidJob, match=r"^job #5: priority"):
        queue.enqueue_many(jobs_, using=OTHER)
    with pytest.raises(InvalidJob, match="lives in database 'other'"):
        jobs.enqueue_many([ReportV1(number=n) for n in range(COPY_AT_LEAST)], using="default")
    assert not on("default").exists() and not on(OTHER).exists()


def test_enqueue_joins_the_transaction_open_on_the_types_database(two_databases):
    with pytest.raises(RuntimeError), transaction.atomic(using=OTHER):
        jobs.enqueue(ReportV1(number=1))
        assert on(OTHER).count() == 1  # inside the transaction, it is there
        raise RuntimeError("the business write failed")
    assert not on(OTHER).exists()  # rolled back with it

    with transaction.atomic(using=OTHER):
        kept = jobs.enqueue(ReportV1(number=2))
    # A transaction on the default alias is not the one that counts for the other alias.
    with pytest.raises(RuntimeError), transaction.atomic():
        outside = jobs.enqueue(ReportV1(number=3))
        raise RuntimeError("rolls back default only")
    assert sorted(on(OTHER).values_list("pk", flat=True)) == sorted([kept.id, outside.id])


def test_jobs_are_routed_by_the_registered_name_and_the_queue_writes_where_told(two_databases):
    assert databases.route([(0, ReportV1.job_name)], None) == OTHER
    assert databases.route([(0, "nobody.registers.v1")], None) == "default"
    raw = queue.enqueue(NewJob(ReportV1.job_name, {"number": 1}), using=OTHER)
    assert on(OTHER).filter(pk=raw.id).exists()
    unregistered = queue.enqueue(NewJob("nobody.registers.v1", {}))
    assert on("default").filter(pk=unregistered.id).exists()


# Workers serve their database -----------------------------------------------------------------


def test_a_worker_runs_the_jobs_of_its_database_and_says_so_to_the_handler(two_databases):
    report = jobs.enqueue(ReportV1(number=1))
    note_there = jobs.enqueue(NoteV1(number=2), using=OTHER)
    note_here = jobs.enqueue(NoteV1(number=3))

    run_worker(registry=two_databases, database=OTHER)

    done = dict(on(OTHER).values_list("pk", "state"))
    assert done == {report.id: "succeeded", note_there.id: "succeeded"}
    assert on(OTHER).get(pk=report.id).result["using"] == OTHER
    assert on("default").get(pk=note_here.id).state == "queued"  # not this worker's

    run_worker(registry=two_databases)  # the home alias's worker
    assert on("default").get(pk=note_here.id).result["using"] == "default"


def test_a_worker_on_another_database_counts_its_attempts_there(two_databases):
    jobs.enqueue(ReportV1(number=1))
    run_worker(registry=two_databases, database=OTHER)

    assert Rollup.objects.using(OTHER).filter(name=ReportV1.job_name).exists()
    assert not Rollup.objects.using("default").filter(name=ReportV1.job_name).exists()


def test_runworker_refuses_an_alias_without_jobs_tables_or_not_configured(two_databases):
    with pytest.raises(CommandError, match=r"alias of settings\.DATABASES .*got 'nowhere'"):
        call_command("runworker", "--database", "nowhere")
    with (
        override_settings(JOBS={"DATABASES": ["default"]}),
        pytest.raises(CommandError, match="'other' is not one of the aliases that hold"),
    ):
        call_command("runworker", "--database", OTHER)
    with connections[OTHER].cursor() as cur:
        cur.execute("ALTER TABLE jobs_job RENAME TO jobs_job_away")
    try:
        with pytest.raises(CommandError, match=r"run manage\.py migrate --database other"):
            call_command("runworker", "--database", OTHER)
    finally:
        with connections[OTHER].cursor() as cur:
            cur.execute("ALTER TABLE jobs_job_away RENAME TO jobs_job")


def test_runworker_refuses_an_alias_whose_jobs_migrations_are_not_all_applied(two_databases):
    """A worker on a schema one migration behind started and then failed every claim that
    needed what the migration made (a fair type's claim calls a function it creates)."""
    from django.db.migrations.loader import MigrationLoader

    latest = max(name for app, name in MigrationLoader(None).disk_migrations if app == "jobs")
    with connections[OTHER].cursor() as cur:
        cur.execute("DELETE FROM django_migrations WHERE app = 'jobs' AND name = %s", [latest])
    try:
        assert databases.problems(OTHER) == [
            f"database 'other' lacks jobs migrations {latest}: "
            "run manage.py migrate --database other"
        ]
        with pytest.raises(CommandError, match=rf"'other' lacks jobs migrations {latest}: run"):
            call_command("runworker", "--database", OTHER)
    finally:
        with connections[OTHER].cursor() as cur:
            cur.execute(
                "INSERT INTO django_migrations (app, name, applied) VALUES ('jobs', %s, now())",
                [latest],
            )


# The scheduler covers every database -------------------------------------------------------


def scheduler(registry: Registry, schedules=()) -> Scheduler:
    return Scheduler(
        SchedulerConfig(install_signal_handlers=False),
        schedules=schedules,
        registry=registry,
    )


def expired_claim(alias: str, name: str) -> int:
    """Claim one job on ``alias`` with a lease already over, as a worker killed mid-job."""
    [claimed] = queue.claim(
        [ClaimRequest(name, 1, 3)],
        scope=AllTenants(),
        limit=1,
        lease=timedelta(milliseconds=1),
        worker="gone:1:dead",
        using=alias,
    )
    return claimed.id


def test_the_watchdog_recovers_an_expired_lease_in_each_database(two_databases):
    jobs.enqueue(ReportV1(number=1))
    jobs.enqueue(NoteV1(number=2))
    there = expired_claim(OTHER, ReportV1.job_name)
    here = expired_claim("default", NoteV1.job_name)

    report = scheduler(two_databases).run_once()

    assert report.led and "watchdog" in report.ran and not report.failed
    assert on(OTHER).get(pk=there).state == "queued"
    assert on("default").get(pk=here).state == "queued"


def test_a_failing_database_does_not_stop_the_duty_on_the_others(two_databases, caplog):
    jobs.enqueue(NoteV1(number=1))
    here = expired_claim("default", NoteV1.job_name)
    sched = scheduler(two_databases)

    def broken(now=None):
        raise RuntimeError("the other server is down")

    sched.watchdog.services[OTHER].run_once = broken  # type: ignore[method-assign]
    report = sched.run_once()

    assert "watchdog" in report.failed and "retention" in report.ran
    assert on("default").get(pk=here).state == "queued"  # the home alias still recovered
    assert "watchdog pass on database other failed" in caplog.text


def test_cron_slots_of_a_bound_type_fire_in_its_database(two_databases):
    schedules = load_schedules(
        {
            "reports": {"cron": "* * * * * *", "job": ReportV1.job_name, "payload": {"number": 7}},
            "notes": {"cron": "* * * * * *", "job": NoteV1.job_name, "payload": {"number": 8}},
        },
        [],
        two_databases,
    )
    report = scheduler(two_databases, schedules).run_once()

    assert "cron" in report.ran and not report.failed
    assert list(on(OTHER).values_list("name", flat=True)) == [ReportV1.job_name]
    assert list(on("default").values_list("name", flat=True)) == [NoteV1.job_name]
    slots = {a: set(ScheduleSlot.objects.using(a).values_list("schedule", flat=True)) for a in BOTH}
    assert slots == {"default": {"notes"}, OTHER: {"reports"}}


def test_archive_and_retention_run_in_each_database(two_databases):
    done = jobs.enqueue(ReportV1(number=1))
    run_worker(registry=two_databases, database=OTHER)
    with connections[OTHER].cursor() as cur:  # finished long enough ago to be archived
        cur.execute(
            "UPDATE jobs_job SET finished_at = finished_at - interval '1 hour' WHERE id = %s",
            [done.id],
        )
    assert scheduler(two_databases).run_once().failed == ()
    assert JobHistory.objects.using(OTHER).filter(pk=done.id, state="succeeded").exists()
    assert not on(OTHER).filter(pk=done.id).exists()


def test_runscheduler_once_says_it_ran_every_duty_over_both_databases(two_databases):
    out = StringIO()
    call_command("runscheduler", "--once", stdout=out)
    assert out.getvalue() == "led: ran cron, watchdog, retention, archive, release, gauges\n"


# Settings and checks ------------------------------------------------------------------------


def test_the_checks_name_an_unknown_or_missing_alias(two_databases, settings):
    settings.JOBS = {"DATABASE": "nowhere"}
    assert [e.id for e in check_databases()] == ["jobs.E040"]
    settings.JOBS = {"DATABASES": ["default", "nowhere"]}
    [unknown, missing] = check_databases()
    assert "'nowhere'" in unknown.msg and unknown.id == "jobs.E041"
    assert "leaves out aliases that hold jobs: 'other'" in missing.msg  # ReportV1 lives there
    settings.JOBS = {"DATABASES": BOTH}
    assert check_databases() == []
    settings.JOBS = {}
    assert databases.configured() == ("default", OTHER)  # derived from the registered types


# The admin shows each database ---------------------------------------------------------------

JOBS_LIST = "/admin/jobs/job/"


def test_the_jobs_list_shows_the_chosen_database_and_offers_each(two_databases, admin_client):
    here = jobs.enqueue(NoteV1(number=1), job_id="note-in-default")
    there = jobs.enqueue(ReportV1(number=2), job_id="report-in-other")

    home = admin_client.get(JOBS_LIST)
    other = admin_client.get(JOBS_LIST, {"database": OTHER})

    assert [r.job_id for r in home.context["cl"].result_list] == [here.job_id]
    assert [r.job_id for r in other.context["cl"].result_list] == [there.job_id]
    assert "Database: other" in other.content.decode()
    assert "Database: default" in home.content.decode()
    [choices] = [f for f in other.context["cl"].filter_specs if isinstance(f, DatabaseFilter)]
    offered = list(choices.choices(other.context["cl"]))
    assert [(c["display"], c["selected"]) for c in offered] == [("default", False), ("other", True)]
    # The row's link keeps the database, and the job's page reads it from there.
    links = {h for h in re_links(other) if f"/{there.id}/change/" in h}
    assert links == {f"{JOBS_LIST}{there.id}/change/?_changelist_filters=database%3Dother"}
    page = admin_client.get(links.pop())
    assert page.context["original"].job_id == there.job_id
    assert "Database: other" in page.content.decode()
    # A job of the other database is found by ?database= as well.
    direct = admin_client.get(f"{JOBS_LIST}{there.id}/change/", {"database": OTHER})
    assert direct.context["original"].job_id == there.job_id


def re_links(response) -> list[str]:
    return [html.unescape(h) for h in re.findall(r'href="([^"]+)"', response.content.decode())]


def test_cancel_and_retry_now_act_on_the_chosen_database(two_databases, admin_client):
    there = jobs.enqueue(ReportV1(number=1), job_id="cancel-me")
    later = jobs.enqueue(ReportV1(number=2), job_id="later", delay=timedelta(hours=1))
    here = jobs.enqueue(NoteV1(number=3), job_id="keep-me")

    url = f"{JOBS_LIST}?database={OTHER}"
    ids = {"_selected_action": [there.id], "post": "yes"}
    admin_client.post(url, {"action": "cancel_selected", **ids})
    admin_client.post(
        url, {"action": "run_now_selected", "_selected_action": [later.id], "post": "yes"}
    )

    assert on(OTHER).get(pk=there.id).state == "cancelled"
    due = on(OTHER).get(pk=later.id)
    assert due.run_after < due.created_at + timedelta(minutes=1)  # due now, not in an hour
    assert on("default").get(pk=here.id).state == "queued"  # same ids or not: untouched
    messages = sorted(LogEntry.objects.values_list("change_message", flat=True))
    assert messages == [
        "Cancelled via the admin jobs list (database other)",
        "Made due now via the admin jobs list (retry now) (database other)",
    ]


def test_the_job_pages_cancel_view_acts_on_its_database(two_databases, admin_client):
    there = jobs.enqueue(ReportV1(number=1))
    page = admin_client.get(f"{JOBS_LIST}{there.id}/change/", {"database": OTHER})
    cancel = page.context["cancel_url"]
    assert cancel.endswith(f"/{there.id}/cancel/?database=other")

    done = admin_client.post(cancel, {"post": "yes"})

    assert done.status_code == 302 and done["Location"].endswith("?database=other")
    assert on(OTHER).get(pk=there.id).state == "cancelled"


def test_the_finished_jobs_list_shows_the_chosen_database(two_databases, admin_client):
    done = jobs.enqueue(ReportV1(number=1))
    run_worker(registry=two_databases, database=OTHER)
    queue.history.archive(now=database_now(OTHER) + timedelta(minutes=1), using=OTHER)

    listed = admin_client.get("/admin/jobs/jobhistory/", {"database": OTHER})
    assert [r.pk for r in listed.context["cl"].result_list] == [done.id]
    assert not admin_client.get("/admin/jobs/jobhistory/").context["cl"].result_list
    # Replay goes through the failure monitor, which reads the default database: not offered.
    assert "replay_selected" not in listed.context["cl"].model_admin.get_actions(
        listed.wsgi_request
    )


def test_with_one_database_the_pages_offer_no_choice(admin_client):
    jobs.enqueue(NoteV1(number=1))
    page = admin_client.get(JOBS_LIST)
    assert "Database:" not in page.content.decode()
    assert not [f for f in page.context["cl"].filter_specs if isinstance(f, DatabaseFilter)]


def test_a_schedule_of_a_bound_type_runs_now_in_its_database_and_is_not_paused_here(
    two_databases, settings, admin_user
):
    from jobs.control import schedules as control

    spec = {"cron": "0 3 * * *", "job": ReportV1.job_name, "payload": {"number": 5}}
    settings.JOBS = {**settings.JOBS, "SCHEDULES": {"nightly-report": spec}}

    done = control.run_now(admin_user, "nightly-report", token="a" * 32, via="the test")

    assert on(OTHER).filter(pk=done.job, job_id=done.job_id).exists()
    assert LogEntry.objects.get().object_id == str(done.job)
    with pytest.raises(ValueError, match="fires in database other"):
        control.pause(admin_user, "nightly-report", via="the test")


def test_a_batch_lives_in_one_database_with_its_members_and_successor(two_databases):
    with pytest.raises(InvalidJob, match="lives in database 'other'"):  # a successor stranded
        jobs.Batch.open(successor=ReportV1(number=0))
    with pytest.raises(InvalidJob, match="lives in database 'other'"), jobs.batch() as batch:
        batch.enqueue(ReportV1(number=1))

    with jobs.batch(successor=ReportV1(number=0), using=OTHER) as batch:
        member = batch.enqueue(NoteV1(number=1))
    run_worker(registry=two_databases, database=OTHER)
    names = sorted(on(OTHER).values_list("name", "state"))
    assert names == [(NoteV1.job_name, "succeeded"), (ReportV1.job_name, "succeeded")]
    assert on(OTHER).filter(pk=member.id, batch_id=batch.id).exists()


class KeepRunAppOffOther:
    """A router that keeps tests.runapp's tables off the ``other`` alias."""

    def allow_migrate(self, db, app_label, **hints):
        return False if (db, app_label) == (OTHER, "runapp") else None


def test_the_watchdog_scans_a_run_table_only_where_the_routers_let_it_live(two_databases, settings):
    from jobs.scheduler.watchdog import Watchdog
    from tests.runapp.models import QuickRun

    row = QuickRun.objects.using(OTHER).create(job_id="run-1", state="running", attempts=1)
    an_hour_ago = database_now(OTHER) - timedelta(hours=1)
    QuickRun.objects.using(OTHER).filter(pk=row.pk).update(heartbeat_at=an_hour_ago)

    settings.DATABASE_ROUTERS = [f"{__name__}.KeepRunAppOffOther"]
    assert "runapp.quickrun:stale" not in Watchdog(using=OTHER).run_once()
    assert QuickRun.objects.using(OTHER).get(pk=row.pk).state == "running"

    settings.DATABASE_ROUTERS = []
    assert Watchdog(using=OTHER).run_once()["runapp.quickrun:stale"] == 1
    assert QuickRun.objects.using(OTHER).get(pk=row.pk).state == "failed"


# manage.py jobs --database ---------------------------------------------------------------------


def test_the_operator_command_pauses_lists_and_cancels_in_the_alias_it_names(two_databases):
    """Pauses are read by the claim of the database they are in: one per alias."""
    from jobs.models import Pause
    from tests.support.admin import operator

    operator("olga", "jobs.pause_work", "jobs.cancel_job")

    def run(*args: str) -> str:
        out = StringIO()
        call_command("jobs", *args, stdout=out)
        return out.getvalue()

    assert run("--database", OTHER, "pause", "job_type", ReportV1.job_name, "--user", "olga") == (
        f"Paused job_type {ReportV1.job_name}.\n"
    )
    assert Pause.objects.using(OTHER).filter(value=ReportV1.job_name).exists()
    assert not Pause.objects.using("default").exists()
    assert ReportV1.job_name in run("--database", OTHER, "paused")
    assert run("paused").strip() == "Nothing is paused."
    [entry] = LogEntry.objects.filter(user__username="olga")
    assert entry.change_message == f"Paused via manage.py jobs (database {OTHER})"

    report = jobs.enqueue(ReportV1(number=7))
    out = run(
        "--database", OTHER, "cancel", "--all", "--job-type", ReportV1.job_name, "--user", "olga"
    )
    assert out.startswith("1 active jobs match; taking 1.")
    assert on(OTHER).get(pk=report.id).state == "cancelled"

    run("--database", OTHER, "resume", "job_type", ReportV1.job_name, "--user", "olga")
    assert not Pause.objects.using(OTHER).exists()

    with pytest.raises(CommandError, match="holds no jobs here"):
        run("--database", "nowhere", "paused")
    with pytest.raises(CommandError, match="schedules are paused in the 'default' database"):
        run("--database", OTHER, "pause", "schedule", "any", "--user", "olga")


class RunThereV1(Payload, name="databases.run_there.v1"):
    """A job of the other database that drives a run row there, retried once in process."""

    run_id: int


def run_there(payload: RunThereV1, ctx: JobContext) -> dict[str, object]:
    if ctx.attempt == 1:
        raise RetryAfter(0.01, "once more, in this process")
    return {"attempt": ctx.attempt, "using": ctx.using}


class EverythingV1(Payload, name="databases.everything.v1"):
    """A job of the other database that uses what a handler can: effects, progress,
    jobs.complete, its batch, a throttle; limited by flow control."""

    number: int


def everything(payload: EverythingV1, ctx: JobContext) -> dict[str, object]:
    ctx.progress(1, 3, "started")
    if payload.number == 0:
        ctx.sleep(0.5)  # over a lease renewal or two: they carry the progress
    key = jobs.effect_key(ctx, "charge")
    charged = jobs.effect(ctx, "charge").run(lambda k: {"charged": k == key})
    batch = jobs.Batch.of(ctx)
    if payload.number == 0 and batch is not None:
        batch.enqueue(EverythingV1(number=9))  # a member adds a member, in the same database
    if payload.number == 1 and ctx.attempt == 1:
        raise RetryAfter(0.01, "the upstream says slow down", throttle=True)
    ctx.progress(3, 3, "done")
    if payload.number == 2:
        with transaction.atomic(using=ctx.using):
            jobs.complete(ctx, {"completed": True})
        return {}
    return {**charged, "in_batch": batch is not None}


class CancelMeV1(Payload, name="databases.cancel_me.v1"):
    """A job of the other database that an operator cancels while it runs (itself, here)."""

    number: int


def cancel_me(payload: CancelMeV1, ctx: JobContext) -> None:
    queue.cancel_running([ctx.id], by="an operator", using=ctx.using)
    if not ctx.cancelled.wait(5):  # learnt at the next lease renewal, in this database
        raise AssertionError("the cancel did not reach the worker")


async def everything_async(payload: AsyncThereV1, ctx: JobContext) -> dict[str, object]:
    ctx.progress(1, 1)
    return {"using": ctx.using}


class AsyncThereV1(Payload, name="databases.async_there.v1"):
    number: int


MORE_TYPES = [
    JobType(RunThereV1, run_there, Policy(database=OTHER, run_model=QuickRun, max_attempts=3)),
    JobType(
        EverythingV1,
        everything,
        Policy(
            database=OTHER,
            max_attempts=3,
            global_concurrency=2,
            tenant_concurrency=1,
            rate_limit=Rate(100, 1),
            fair=True,
        ),
    ),
    JobType(AsyncThereV1, everything_async, Policy(database=OTHER, max_attempts=3)),
    JobType(CancelMeV1, cancel_me, Policy(database=OTHER, max_attempts=3)),
]


@pytest.fixture
def registry(monkeypatch, settings) -> Registry:
    """The dbapp types and this module's, registered; both aliases configured for jobs."""
    registry = Registry([*get_registry(), *job_types(), *MORE_TYPES])
    monkeypatch.setattr(catalogue, "_registry", registry)
    settings.JOBS = {**settings.JOBS, "DATABASES": BOTH}
    return registry


@contextlib.contextmanager
def unreachable(alias: str) -> Iterator[None]:
    """New connections to ``alias`` fail, from any thread (as when its server is down).

    Connections already open (the test's own) stay open, so the test can look afterwards.
    """
    settings_dict = connections.settings[alias]
    host = settings_dict["HOST"]
    settings_dict["HOST"] = "/nonexistent/jobs-unreachable-socket-dir"
    try:
        yield
    finally:
        settings_dict["HOST"] = host


def test_a_worker_on_the_other_database_runs_its_run_row_jobs_with_default_down(registry):
    """The worker's own writes on a handler thread (the run row's start, the next attempt of an
    in-process retry) went through a bounded transaction on ``default``: with that server down,
    every run-row job of the other database failed, though nothing of it lives on default."""
    row = QuickRun.objects.using(OTHER).create(job_id="run-there", state="queued")
    done = jobs.enqueue(RunThereV1(run_id=row.pk))

    with unreachable("default"):
        run_worker(registry=registry, database=OTHER)

    job = Job.objects.using(OTHER).get(pk=done.id)
    assert (job.state, job.attempts, job.result) == ("succeeded", 2, {"attempt": 2, "using": OTHER})
    ran = QuickRun.objects.using(OTHER).get(pk=row.pk)
    assert (ran.state, ran.attempts) == ("succeeded", 2)


def test_a_worker_on_the_other_database_needs_nothing_of_default_for_any_feature(
    registry, settings, caplog
):
    """Effects, progress, lease renewals, an operator's cancel, jobs.complete, batches,
    throttles, flow limits, async handlers and unbound types: all of a worker's statements go
    to its alias while default is down."""
    settings.JOBS = {**settings.JOBS, "LEASE": 0.3}  # renewals every 0.1 s
    with jobs.batch(using=OTHER) as batch:
        batch.enqueue_many([EverythingV1(number=n) for n in range(3)], tenant="t1")
    jobs.enqueue(AsyncThereV1(number=1))
    note = jobs.enqueue(NoteV1(number=1), using=OTHER)
    cancelled = jobs.enqueue(CancelMeV1(number=1))

    with unreachable("default"):
        run_worker(registry=registry, database=OTHER)

    rows = Job.objects.using(OTHER)
    assert rows.get(pk=cancelled.id).state == "cancelled"
    rows = rows.exclude(pk=cancelled.id)
    assert set(rows.values_list("state", flat=True)) == {"succeeded"}
    assert rows.count() == 6  # three members, the one a member added, async, the note
    assert rows.get(pk=note.id).result["using"] == OTHER
    assert jobs.Batch(batch.id, OTHER).state().succeeded == 4
    reported = rows.filter(name=EverythingV1.job_name).exclude(payload__number=2)  # complete()
    assert all(row.progress for row in reported)
    assert "jobs-unreachable-socket-dir" not in caplog.text  # no attempt on default, even logged


def test_the_scheduler_keeps_the_home_database_going_while_the_other_server_is_down(
    registry, monkeypatch, caplog
):
    """Down at start-up, and back during the run: the home alias's duties go on meanwhile,
    and the other alias's resume once it is back, without a restart."""
    monkeypatch.setattr(Outages, "REST", 0.2)
    jobs.enqueue(NoteV1(number=1))
    here = expired_claim("default", NoteV1.job_name)
    schedules = load_schedules(
        {
            "notes": {"cron": "* * * * * *", "job": NoteV1.job_name, "payload": {"number": 2}},
            "reports": {"cron": "* * * * * *", "job": ReportV1.job_name, "payload": {"number": 3}},
        },
        [],
        registry,
    )
    sched = scheduler(registry, schedules)
    host = connections.settings[OTHER]["HOST"]
    first: dict[str, bool] = {}
    deadline = time.monotonic() + 5

    def until(s: Scheduler) -> bool:
        if not first:
            first.update(s.last_pass)
            connections[OTHER].settings_dict["HOST"] = host  # back (in the loop's own copy)
            return False
        back = ScheduleSlot.objects.using(OTHER).filter(schedule="reports").exists()
        return back or time.monotonic() > deadline

    with unreachable(OTHER):
        sched.run(until=until)

    # Every duty missed the other alias (and says so), the home one did its work.
    assert first == dict.fromkeys(
        ["cron", "watchdog", "retention", "archive", "release", "gauges"], False
    )
    assert Job.objects.get(pk=here).state == "queued"  # the home alias's lease recovered
    assert Job.objects.filter(job_id__startswith="cron:notes:").exists()  # and its cron fired
    # The first duty found it gone; the others passed it over while it rested.
    assert "cron pass on database other failed; it rests 0.2s" in caplog.text
    assert "watchdog pass on database other failed" not in caplog.text
    # Back: its duties resume in the same run.
    assert Job.objects.using(OTHER).filter(job_id__startswith="cron:reports:").exists()
    assert "database other is reachable again" in caplog.text


def target_of(alias: str) -> str | tuple[str, int]:
    """Where ``alias``'s server listens: a Unix socket path, or (host, port)."""
    params = connections.settings[alias]
    host, port = params["HOST"] or "localhost", int(params.get("PORT") or 5432)
    return os.path.join(host, f".s.PGSQL.{port}") if host.startswith("/") else (host, port)


@contextlib.contextmanager
def through(proxy: TcpProxy, alias: str) -> Iterator[None]:
    """New connections to ``alias`` go through ``proxy`` (the test's own is reopened after)."""
    params = connections.settings[alias]
    saved = params["HOST"], params["PORT"]
    connections[alias].close()
    params["HOST"], params["PORT"] = proxy.host, str(proxy.port)
    try:
        yield
    finally:
        proxy.thaw()
        params["HOST"], params["PORT"] = saved
        connections[alias].close()


@pytest.mark.slow
def test_a_silent_other_server_delays_the_home_databases_cron_by_one_stall_at_most(
    registry, settings, caplog
):
    """A server that stops answering (a hung pooler, a dead path TCP cannot see) costs the home
    database's cron one stall at most: the stuck call is cut without stepping down, and the
    alias rests before it is tried again, rather than every duty that visits it stalling for
    the leader timeout and losing leadership, firing the home database's per-second schedule
    in bursts, seconds late."""
    settings.JOBS = {**settings.JOBS, "DB_NETWORK_TIMEOUT": 1, "SCHEDULER_LEADER_TIMEOUT": 2}
    schedules = load_schedules(
        {
            "notes": {"cron": "* * * * * *", "job": NoteV1.job_name, "payload": {"number": 2}},
            "reports": {"cron": "* * * * * *", "job": ReportV1.job_name, "payload": {"number": 3}},
        },
        [],
        registry,
    )
    frozen: list[float] = []

    def until(sched: Scheduler) -> bool:
        if not frozen and sched.passes >= 1:
            proxy.freeze()
            frozen.append(time.monotonic())
        return bool(frozen) and time.monotonic() - frozen[0] > 4.5

    with TcpProxy(target_of(OTHER)) as proxy, through(proxy, OTHER):
        scheduler(registry, schedules).run(until=until)

    late = [
        (row.recorded_at - row.slot).total_seconds()
        for row in ScheduleSlot.objects.filter(schedule="notes").order_by("slot")
    ]
    assert len(late) >= 5
    assert "lost leadership" not in caplog.text
    assert max(late) < 2.5, late  # one stall of the leader timeout, not one per duty
    assert sum(seconds > 1.5 for seconds in late) <= 1, late  # and only one


def test_the_schedulers_connection_to_another_database_gives_up_within_half_the_leader_timeout(
    registry, settings
):
    """The stall guard cannot cut a connect short: with the default bounds (a 10 s network
    timeout, a 10 s leader timeout) a silent server would win the race and cost leadership."""
    sched = scheduler(registry)
    assert sched._bounds(OTHER).network_timeout == 5.0
    assert sched._bounds("default").network_timeout == timedelta(seconds=10)
    settings.JOBS = {**settings.JOBS, "DB_NETWORK_TIMEOUT": 3}
    assert sched._bounds(OTHER).network_timeout == timedelta(seconds=3)  # shorter: kept


PAUSE_ADD = "/admin/jobs/pause/add/"


def command(*args: str) -> str:
    out = StringIO()
    call_command("jobs", *args, stdout=out)
    return out.getvalue()


def test_pausing_a_type_or_schedule_of_another_database_here_is_refused_not_ignored(
    registry, settings
):
    """The workers of the other database read its pauses there: a pause of one of its types,
    or of a schedule firing there, recorded in default held nothing back, yet said "Paused"
    (the pauses page and manage.py jobs without --database let both through)."""
    from tests.support.admin import client_for, operator

    spec = {"cron": "0 3 * * *", "job": ReportV1.job_name, "payload": {"number": 5}}
    settings.JOBS = {**settings.JOBS, "SCHEDULES": {"nightly-report": spec}}
    olga = operator("olga", "jobs.pause_work")
    admin = client_for(olga)

    for kind, value in (("job_type", ReportV1.job_name), ("schedule", "nightly-report")):
        page = admin.post(PAUSE_ADD, {"kind": kind, "value": value, "post": "yes"})
        assert page.status_code == 200, page  # the form again, saying why
        assert "lives in database other" in str(page.context["form"].errors["value"])
        with pytest.raises(CommandError, match="lives in database other"):
            command("pause", kind, value, "--user", "olga")
    assert not Pause.objects.using("default").exists()
    assert not Pause.objects.using(OTHER).exists()

    # Where it lives, the type pauses; unbound types, queues and tenants pause anywhere.
    command("--database", OTHER, "pause", "job_type", ReportV1.job_name, "--user", "olga")
    command("pause", "job_type", NoteV1.job_name, "--user", "olga")
    command("--database", OTHER, "pause", "tenant", "t1", "--user", "olga")
    assert set(Pause.objects.using(OTHER).values_list("value", flat=True)) == {
        ReportV1.job_name,
        "t1",
    }
    assert list(Pause.objects.values_list("value", flat=True)) == [NoteV1.job_name]


def test_the_pauses_page_refuses_a_database_that_holds_no_jobs(registry, settings):
    """With every job in another database (JOBS["DATABASE"]), the pauses page still writes to
    default, where no worker reads: refused, saying why."""
    from tests.support.admin import client_for, operator

    settings.JOBS = {**settings.JOBS, "DATABASE": OTHER, "DATABASES": [OTHER]}
    admin = client_for(operator("olga", "jobs.pause_work"))

    page = admin.post(PAUSE_ADD, {"kind": "queue", "value": "bulk", "post": "yes"})

    assert page.status_code == 200
    assert "database default holds no jobs" in str(page.context["form"].errors["value"])
    assert not Pause.objects.using("default").exists()


def test_a_batch_without_using_goes_where_enqueue_puts_unbound_jobs(registry, settings):
    """jobs.enqueue() sends an unbound type's jobs to JOBS["DATABASE"]; jobs.batch() and
    Batch.open() sent them to Django's default alias instead, where no worker looked."""
    settings.JOBS = {**settings.JOBS, "DATABASE": OTHER}

    with jobs.batch(successor=NoteV1(number=0)) as batch:
        member = batch.enqueue(NoteV1(number=1))
    opened = jobs.Batch.open()
    opened.enqueue(NoteV1(number=2))
    opened.seal()

    assert (batch.using, opened.using) == (OTHER, OTHER)
    assert Job.objects.using(OTHER).filter(pk=member.id, batch_id=batch.id).exists()
    assert not Job.objects.using("default").exists()
    run_worker(registry=registry)  # the home alias's worker, as runworker without --database
    assert jobs.Batch(batch.id, OTHER).state().succeeded == 1
    assert jobs.Batch(opened.id).state().succeeded == 1  # a handle names the home alias too


def next_id_in(alias: str, value: int) -> None:
    """Make the next job row id of ``alias`` be ``value`` (each database counts its own)."""
    with connections[alias].cursor() as cur:
        cur.execute("SELECT setval(pg_get_serial_sequence('jobs_job', 'id'), %s, false)", [value])


def test_a_job_cannot_wait_for_an_enqueued_job_of_another_database(registry):
    """Row ids are per database: a note (default) told to wait for a report (other) waited
    for whichever default job had the report's id, an unrelated one, and said nothing."""
    report = jobs.enqueue(ReportV1(number=1))
    next_id_in("default", report.id)
    unrelated = jobs.enqueue(NoteV1(number=0), job_id="unrelated")
    assert unrelated.id == report.id  # the same number, two different jobs

    with pytest.raises(InvalidJob, match=r"after: job .* is in database 'other'.*'default'"):
        jobs.enqueue(NoteV1(number=2), after=[report])
    with pytest.raises(InvalidJob, match="is in database 'other'"), jobs.batch() as batch:
        batch.enqueue(NoteV1(number=3), after=[report])
    assert list(Job.objects.values_list("pk", flat=True)) == [unrelated.id]

    # In the report's own database it waits for the report, as asked.
    there = jobs.enqueue(NoteV1(number=4), after=[report], using=OTHER)
    assert (there.state, Job.objects.using(OTHER).get(pk=there.id).waiting_on) == ("queued", 1)
    assert report.using == OTHER and unrelated.using == "default"


def test_runworker_checks_a_silent_database_within_its_bounds_then_starts(registry, settings):
    """runworker --database reads the alias's tables before starting; on a server that
    accepts connections but never answers, that read had no bound and hung the command
    before it logged anything or served /healthz. Now it gives up within the network bound
    and starts (the worker then retries, as for any outage)."""
    settings.JOBS = {**settings.JOBS, "DB_NETWORK_TIMEOUT": 1}
    found: list[list[str]] = []
    with TcpProxy(target_of(OTHER)) as proxy, through(proxy, OTHER):
        proxy.freeze()
        check = threading.Thread(target=lambda: found.append(databases.problems(OTHER)))
        check.start()
        check.join(timeout=8)
        answered = not check.is_alive()
        proxy.close()  # a check still stuck fails now, so the thread ends either way
        check.join()
    assert answered, "the check of a silent database hung"
    assert found == [[]]  # unreachable now: not refused


def test_the_checks_report_malformed_database_settings_instead_of_crashing(registry, settings):
    """A list inside JOBS["DATABASES"], or a non-string JOBS["DATABASE"] next to a listed
    JOBS["DATABASES"], made check_databases raise TypeError: manage.py check (and every
    command that runs the checks) died with a traceback instead of naming the setting."""
    settings.JOBS = {"DATABASES": [["default"]]}
    [error] = check_databases()
    assert error.id == "jobs.E041" and "got [['default']]" in error.msg

    settings.JOBS = {"DATABASE": ["default"], "DATABASES": BOTH}
    [error] = check_databases()
    assert error.id == "jobs.E040" and "got ['default']" in error.msg


def test_a_task_backend_naming_an_unknown_alias_is_a_check_error_not_a_scheduler_crash(
    registry, settings
):
    """TASKS[...]["OPTIONS"]["DATABASE"] counts among the aliases that hold jobs, but no
    check looked at it: a typo passed manage.py check, then runscheduler died at start-up
    (ConnectionDoesNotExist) and every task enqueue failed."""
    backend = {"BACKEND": "jobs.backends.PostgresBackend", "OPTIONS": {"DATABASE": "reprots"}}
    settings.TASKS = {"default": backend}
    settings.JOBS = {}

    [error] = check_databases()

    assert error.id == "jobs.E040"
    assert error.msg == (
        "TASKS['default']['OPTIONS']['DATABASE'] must be an alias of settings.DATABASES, "
        "got 'reprots'."
    )


def test_a_crafted_database_parameter_reads_and_acts_on_the_home_database_only(
    registry, admin_client, settings
):
    """An alias Django has but JOBS["DATABASES"] leaves out, an unknown one, or markup: the
    pages show the home database and actions act there; nothing is echoed back."""
    settings.JOBS = {**settings.JOBS, "DATABASES": ["default"]}
    here = jobs.enqueue(NoteV1(number=1))
    jobs.enqueue(NoteV1(number=2), using=OTHER)  # a Django alias, left out of JOBS["DATABASES"]

    for value in (OTHER, "nowhere", "<b>x</b>", ""):
        page = admin_client.get(JOBS_LIST, {"database": value})
        assert [r.pk for r in page.context["cl"].result_list] == [here.id], value
        assert "<b>x</b>" not in page.content.decode()
        admin_client.post(
            f"{JOBS_LIST}?database={value}",
            {"action": "cancel_selected", "_selected_action": [here.id], "post": "yes"},
        )
        job_page = admin_client.get(f"{JOBS_LIST}{here.id}/change/", {"database": value})
        assert job_page.context["original"].pk == here.id
    assert Job.objects.get(pk=here.id).state == "cancelled"
    assert Job.objects.using(OTHER).get().state == "queued"  # untouched


@task(takes_context=True)
def whoami(context, label: str) -> dict:
    """What the task's context says it is."""
    return {"label": label, "context_args": list(context.task_result.args)}


def tasks_in(alias: str) -> dict:
    return {"default": {"BACKEND": "jobs.backends.PostgresBackend", "OPTIONS": {"DATABASE": alias}}}


def test_a_task_run_where_its_job_is_reads_its_own_result_there(registry, settings):
    """The worker's task handler read the task's result (the context's task_result, the
    signals' argument) from the backend's DATABASE, not from the database the job was
    claimed in: after the backend moved to another alias, a task still queued in the old one
    got the result of whichever task had its id in the new one."""
    settings.TASKS = tasks_in("default")
    mine = whoami.enqueue("mine")
    next_id_in(OTHER, int(mine.id))
    settings.TASKS = tasks_in(OTHER)  # the backend moves; one task is still queued in default
    theirs = whoami.enqueue("theirs")
    assert theirs.id == mine.id  # the same number, two different tasks

    run_worker(registry=registry)  # the default alias's worker runs the one left there

    assert Job.objects.get(pk=int(mine.id)).result == {
        "label": "mine",
        "context_args": ["mine"],
    }


def test_the_links_of_a_job_page_of_the_other_database_keep_it(registry, admin_client):
    """Reached by ?database= (as the cancel view sends one back), the page's History link and
    its way back to the list dropped the alias: History showed the default job that has the
    same id, and the list the default database."""
    report = jobs.enqueue(ReportV1(number=1))
    next_id_in("default", report.id)
    namesake = jobs.enqueue(NoteV1(number=2), job_id="namesake")
    assert namesake.id == report.id

    page = admin_client.get(f"{JOBS_LIST}{report.id}/change/", {"database": OTHER})
    assert page.context["original"].job_id == report.job_id
    links = re_links(page)
    [history] = [h for h in links if f"/{report.id}/history/" in h]
    assert admin_client.get(history).context["object"].job_id == report.job_id
    assert f"{JOBS_LIST}?database=other" in links  # the breadcrumbs' way back to the list


@pytest.mark.slow
def test_a_loop_still_stuck_after_its_call_on_the_other_database_is_cut_gives_up_leading(
    registry, settings, caplog
):
    """Cutting the other alias's connection unsticks a call stuck there; if the loop is stuck
    on something else meanwhile, it must not keep leadership for ever: half a leader timeout
    later it steps down, as for a stall on the home alias."""
    settings.JOBS = {**settings.JOBS, "SCHEDULER_LEADER_TIMEOUT": 2}
    sched = scheduler(registry)
    release = threading.Event()

    def stuck_elsewhere(now=None):
        with connections[OTHER].cursor() as cur:  # the connection the guard will cut
            cur.execute("SELECT 1")
        release.wait(10)  # stuck, but not in a statement on that connection
        return {}

    sched.watchdog.services[OTHER].run_once = stuck_elsewhere  # type: ignore[method-assign]
    threading.Timer(8, release.set).start()  # the test's own bound
    started = time.monotonic()

    def until(s: Scheduler) -> bool:
        return not s.leadership.leading or time.monotonic() - started > 8

    def watch() -> None:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and "lost leadership" not in caplog.text:
            release.wait(0.05)
        release.set()

    threading.Thread(target=watch, daemon=True).start()
    sched.run(until=until)

    assert "aborted its connection to database other" in caplog.text
    assert "lost leadership" in caplog.text
    assert time.monotonic() - started < 6
