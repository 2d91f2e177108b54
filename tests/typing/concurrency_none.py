"""A user module that states "no limit of its own" explicitly: mypy must accept it.

Never imported (its job type would join the registry): tests/unit/test_typing.py runs mypy
on it. ``concurrency=None`` is the documented default of a policy.
"""

from __future__ import annotations

from jobs import JobContext, Payload, Policy, job


class NoLimitV1(Payload, name="typing.nolimit.v1"):
    n: int = 0


@job(NoLimitV1, concurrency=None)
def handle(payload: NoLimitV1, ctx: JobContext) -> None:
    return None


POLICY = Policy(concurrency=None)
