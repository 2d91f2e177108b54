"""A scheduled job for the demo, so the scheduler has a schedule to fire and report on."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db.models import Count

from jobs import JobContext, Payload, job
from jobs.models import Job
from jobs.scheduler import schedule

logger = logging.getLogger("project.demo")


class FailureDigestV1(Payload, name="demo.failure_digest.v1"):
    """Count failed jobs per type; stands for a periodic report a project would send."""


@job(FailureDigestV1, timeout=timedelta(seconds=30), max_attempts=3)
def failure_digest(payload: FailureDigestV1, ctx: JobContext) -> dict[str, int]:
    counts = dict(Job.objects.filter(state="failed").values_list("name").annotate(n=Count("id")))
    ctx.logger.info("failed jobs by type: %s", counts or "none")
    return counts


# Every minute; slots missed while no scheduler ran are skipped, not caught up.
schedule("failure-digest", "* * * * *", FailureDigestV1(), misfire="skip")


# -- fan-out and fan-in: an import that runs a job per line and reports once at the end -----


class ImportFileV1(Payload, name="demo.import_file.v1"):
    """Import ``lines`` of ``name,email``: one member job per line, then one report."""

    source: str
    lines: list[str]


class ImportLineV1(Payload, name="demo.import_line.v1"):
    source: str
    number: int
    line: str


class ImportReportV1(Payload, name="demo.import_report.v1"):
    source: str


@job(ImportFileV1, timeout=timedelta(seconds=60), max_attempts=3)
def import_file(payload: ImportFileV1, ctx: JobContext) -> dict[str, int]:
    from jobs import batch

    # One transaction: the batch, its members and its successor commit together, or (on a
    # retry after a crash here) not at all.
    with batch(
        successor=ImportReportV1(source=payload.source), description=f"import {payload.source}"
    ) as group:
        group.enqueue_many(
            [
                ImportLineV1(source=payload.source, number=number, line=line)
                for number, line in enumerate(payload.lines, start=1)
            ]
        )
    return {"batch": group.id, "lines": len(payload.lines)}


@job(ImportLineV1, timeout=timedelta(seconds=30), max_attempts=2)
def import_line(payload: ImportLineV1, ctx: JobContext) -> dict[str, str]:
    from jobs import Reject

    name, _, email = payload.line.partition(",")
    if "@" not in email:
        raise Reject(f"line {payload.number}: no email address in {payload.line!r}")
    return {"name": name.strip(), "email": email.strip()}


@job(ImportReportV1, timeout=timedelta(seconds=30), max_attempts=3)
def import_report(payload: ImportReportV1, ctx: JobContext) -> dict[str, object]:
    """Runs once, after every line has finished, however many failed."""
    from jobs import Batch

    group = Batch.finished_by(ctx)
    if group is None:  # enqueued by hand, not by a batch
        return {"source": payload.source, "lines": 0}
    state = group.state()
    # The last line of each failure's detail: the exception and its message.
    failures = [f.error_detail.strip().splitlines()[-1] for f in group.failures(limit=20)]
    ctx.logger.info(
        "import %s: %d lines, %d imported, %d failed",
        payload.source,
        state.total,
        state.succeeded,
        state.failed + state.cancelled,
    )
    return {
        "source": payload.source,
        "lines": state.total,
        "imported": state.succeeded,
        "failed": state.failed + state.cancelled,
        "failures": failures,
    }
