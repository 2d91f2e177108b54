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
