"""factory-boy factories that create rows directly in any state (for arranging tests)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import factory
from django.utils import timezone

from jobs.models import Job, TenantOverride
from jobs.runs import ErrorCode, RunState


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    job_id = factory.Sequence(lambda n: f"job-{n}")
    name = "test.noop.v1"
    payload = factory.Dict({})
    tenant = "default"
    queue = "default"
    priority = 0
    max_attempts = 5
    state = RunState.QUEUED

    class Params:
        running = factory.Trait(
            state=RunState.RUNNING,
            attempts=1,
            claim_token=factory.LazyFunction(uuid.uuid4),
            lease_expires_at=factory.LazyFunction(lambda: timezone.now() + timedelta(seconds=10)),
            heartbeat_at=factory.LazyFunction(timezone.now),
            started_at=factory.LazyFunction(timezone.now),
            claimed_by="factory",
        )
        succeeded = factory.Trait(
            state=RunState.SUCCEEDED,
            attempts=1,
            finished_at=factory.LazyFunction(timezone.now),
        )
        failed = factory.Trait(
            state=RunState.FAILED,
            attempts=5,
            last_error=ErrorCode.HANDLER_ERROR,
            error_detail="boom",
            finished_at=factory.LazyFunction(timezone.now),
        )


class TenantOverrideFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = TenantOverride

    tenant = factory.Sequence(lambda n: f"tenant-{n}")
    component = "worker"
