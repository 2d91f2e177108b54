"""One job type, so the smoke test can enqueue a job and watch a worker run it."""

from __future__ import annotations

from datetime import timedelta

from jobs import JobContext, Payload, job


class EchoV1(Payload, name="smoke.echo.v1"):
    word: str


@job(EchoV1, max_attempts=1, timeout=timedelta(seconds=30))
def echo(payload: EchoV1, ctx: JobContext) -> dict:
    """Return the word and the attempt, stored as the job's result for the test to compare."""
    return {"echo": payload.word, "attempt": ctx.attempt}
