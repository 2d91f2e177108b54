"""Job types declared the way a user's app declares them; discovered by ``JobsConfig.ready``."""

from __future__ import annotations

from datetime import timedelta

from jobs import JobContext, Payload, Policy, job, register


class PingV1(Payload, name="jobapp.ping.v1"):
    """A payload whose type is registered with the decorator and its policy options."""

    message: str


class AuditV1(Payload, name="jobapp.audit.v1"):
    """A payload registered with register() and a shared Policy value, for an async handler."""

    entry_id: int


@job(PingV1, concurrency=3, timeout=20, max_attempts=4, queue="pings", priority=5)
def ping(payload: PingV1, ctx: JobContext) -> str:
    return payload.message


async def audit(payload: AuditV1, ctx: JobContext) -> None:
    return None


AUDIT_POLICY = Policy(timeout=timedelta(seconds=5), max_attempts=2)
register(AuditV1, audit, policy=AUDIT_POLICY)
