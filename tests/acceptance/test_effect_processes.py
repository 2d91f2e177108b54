"""The effect journal across a ``kill -9`` of a real ``runworker`` mid-effect.

The handler (tests/procapp/jobs.py, ``test.effect_charge.v1``) charges through a pretend
provider, a table that keeps one row per idempotency key and counts the requests made with
it. Its first attempt records the intent, signals the test and blocks, after or before the
provider took the charge; the test kills the worker, a second one takes the job once the
lease expires, and the charge must exist exactly once with its result in the journal.
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import enqueue
from jobs.models import Effect, Job
from tests.procapp.jobs import Charge
from tests.support.polling import wait_for
from tests.support.processes import read_trace

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.acceptance, pytest.mark.slow]

FAST = ["--poll-interval", "0.1", "--maintenance-interval", "0.2"]


@pytest.fixture
def provider():
    with connection.cursor() as cur:
        cur.execute(
            "CREATE TABLE IF NOT EXISTS test_provider_charges (id bigserial PRIMARY KEY, "
            "key text UNIQUE NOT NULL, amount int NOT NULL, requests int NOT NULL DEFAULT 1)"
        )
        cur.execute("TRUNCATE test_provider_charges")
    yield
    with connection.cursor() as cur:
        cur.execute("DROP TABLE test_provider_charges")


def charges() -> list[tuple[int, str, int, int]]:
    with connection.cursor() as cur:
        cur.execute("SELECT id, key, amount, requests FROM test_provider_charges ORDER BY id")
        return list(cur.fetchall())


@pytest.mark.parametrize("block", ["after_call", "before_call"])
def test_kill_9_mid_effect_charges_exactly_once(spawn, tmp_path, provider, block):
    trace, signal = tmp_path / "trace", tmp_path / "signal"
    job = enqueue(Charge(amount=250, path=str(trace), signal=str(signal), block=block))
    first = spawn("runworker", *FAST, lease=1.0)
    wait_for(signal.exists, what="the first attempt is mid-effect", timeout=20)
    first.proc.kill()  # SIGKILL: the result is never recorded
    first.wait()

    [intent] = Effect.objects.filter(job=job.id)
    assert (intent.step, intent.state, intent.attempt) == ("charge", "intent", 1)
    assert len(charges()) == (1 if block == "after_call" else 0)

    spawn("runworker", *FAST, lease=1.0)  # takes the job once its lease has expired
    wait_for(
        lambda: Job.objects.get(pk=job.id).state == "succeeded",
        what="the job succeeded on the second worker",
        timeout=20,
    )

    [(charge_id, key, amount, requests)] = charges()
    assert (key, amount, requests) == (intent.key, 250, 1), "one charge, one request"
    done = Effect.objects.get(job=job.id, step="charge")
    assert (done.state, done.result, done.attempt) == ("done", {"charge": charge_id}, 2)
    row = Job.objects.get(pk=job.id)
    assert (row.attempts, row.result) == (2, {"charge": charge_id})
    seen = [(line[0], line[2]) for line in read_trace(trace)]
    if block == "after_call":  # the provider had it: found, not asked again
        assert seen == [("call", "1"), ("reconcile", "2")]
    else:  # it never reached the provider: found nothing, so called again, same key
        assert seen == [("call", "1"), ("reconcile", "2"), ("call", "2")]
