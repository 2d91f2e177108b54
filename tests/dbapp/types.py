"""The payloads and handlers of the several-databases tests, registered by ``jobs.py``.

Kept apart from the registration so the test session can build registries of them without
installing the app (see ``tests/dbapp/__init__.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from jobs import JobContext, Payload
from jobs.catalogue.registry import JobType, Policy

#: The alias the bound type lives in.
OTHER = "other"


class ReportV1(Payload, name="dbapp.report.v1"):
    """Work that lives in the ``other`` database: its job type says so."""

    number: int
    seconds: float = 0.0


class NoteV1(Payload, name="dbapp.note.v1"):
    """Work of an unbound type: ``JOBS["DATABASE"]`` unless enqueued elsewhere."""

    number: int
    seconds: float = 0.0


def run(payload: ReportV1 | NoteV1, ctx: JobContext) -> dict[str, Any]:
    """Say which database the worker ran the job on, and which process."""
    if payload.seconds:
        time.sleep(payload.seconds)
    return {"using": ctx.using, "pid": os.getpid()}


def job_types() -> list[JobType]:
    """The two types as ``tests/dbapp/jobs.py`` registers them."""
    return [
        JobType(ReportV1, run, Policy(database=OTHER, max_attempts=3)),
        JobType(NoteV1, run, Policy(max_attempts=3)),
    ]
