"""Several databases: a job type that lives in another alias, end to end in one process.

The ``other`` alias is a second PostgreSQL server (tests/support/otherdb.py; a second database on
the default server where no second server can start). Its job types (tests/dbapp) are put in the
process registry by the ``two_databases`` fixture only, so no other test meets them.
"""

from __future__ import annotations

import html
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test import override_settings

import jobs
from jobs import databases, queue
from jobs.databases import check_databases
from jobs.models import Job, JobHistory, Rollup, ScheduleSlot
from jobs.monitor.databases import DatabaseFilter
from jobs.queue import AllTenants, ClaimRequest, InvalidJob, NewJob
from jobs.registry import Registry, catalogue, get_registry
from jobs.scheduler.clock import database_now
from jobs.scheduler.config import SchedulerConfig
from jobs.scheduler.runner import Scheduler
from jobs.scheduler.schedules import load_schedules
from jobs.testing import run_worker
from tests.dbapp.types import OTHER, NoteV1, ReportV1, job_types
from tests.support import otherdb

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
    with pytest.raises(InvalidJob, match="lives in database 'other'"):  # the raw queue too
        queue.enqueue(NewJob(ReportV1.job_name, {"number": 3}), using="default")
    assert not on("default").exists() and not on(OTHER).exists()

    # With using=, an unbound type goes along with the bound one.
    both = jobs.enqueue_many([NoteV1(number=1), ReportV1(number=2)], using=OTHER)
    assert {job.id for job in both} == set(on(OTHER).values_list("pk", flat=True))


def test_a_large_batch_reports_an_invalid_job_before_its_database(two_databases):
    """Which error a batch reports does not depend on the path that inserts it (by COPY
    from COPY_AT_LEAST keyless jobs on): an invalid job first, then a database mismatch."""
    from jobs.queue.enqueue import COPY_AT_LEAST

    jobs_ = [NewJob(ReportV1.job_name, {"number": n}) for n in range(COPY_AT_LEAST)]
    jobs_[5] = NewJob(ReportV1.job_name, {"number": 5}, priority="high")
    with pytest.raises(InvalidJob, match=r"^job #5: priority"):
        queue.enqueue_many(jobs_, using="default")
    jobs_[5] = NewJob(ReportV1.job_name, {"number": 5})
    with pytest.raises(InvalidJob, match="lives in database 'other'"):
        queue.enqueue_many(jobs_, using="default")
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


def test_the_raw_queue_routes_by_the_registered_name_too(two_databases):
    raw = queue.enqueue(NewJob(ReportV1.job_name, {"number": 1}))
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
