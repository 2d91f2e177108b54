"""The demo's import runs end to end through the real worker: fan out, then one report."""

from __future__ import annotations

import pytest

import jobs
from jobs.models import Batch, Job
from jobs.testing import JobFailed, run_worker
from project.demo.jobs import ImportFileV1, ImportLineV1, ImportReportV1

pytestmark = pytest.mark.django_db(transaction=True)


def run_until_done() -> list[JobFailed]:
    """run_worker() stops at each terminal failure: the import's bad lines fail on purpose."""
    failures = []
    while True:
        try:
            run_worker(timeout=20)
        except JobFailed as failure:
            failures.append(failure)
        else:
            return failures


def test_an_import_fans_out_and_reports_once_with_its_failures():
    lines = ["Ada,ada@example.com", "Grace,grace@example.com", "no email here", "Alan,alan@x.io"]
    jobs.enqueue(ImportFileV1(source="crm.csv", lines=lines))

    failed = run_until_done()

    assert [f.name for f in failed] == [ImportLineV1.job_name]
    [report] = Job.objects.filter(name=ImportReportV1.job_name)
    assert report.state == "succeeded"
    assert report.result == {
        "source": "crm.csv",
        "lines": 4,
        "imported": 3,
        "failed": 1,
        "failures": ["jobs.errors.Reject: line 3: no email address in 'no email here'"],
    }
    [batch] = Batch.objects.all()
    assert (batch.total, batch.succeeded, batch.failed, batch.successor_pk) == (4, 3, 1, report.pk)


def test_an_empty_import_still_reports():
    jobs.enqueue(ImportFileV1(source="empty.csv", lines=[]))
    assert run_until_done() == []
    [report] = Job.objects.filter(name=ImportReportV1.job_name)
    assert report.result["lines"] == 0 and report.state == "succeeded"
