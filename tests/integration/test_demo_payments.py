"""The demo's payment runs end to end through the real worker: charged once, also when the
provider's first answer is lost (a worker killed mid-call: tests/acceptance/
test_effect_processes.py)."""

from __future__ import annotations

import pytest

import jobs
from jobs.api.effects import key_for
from jobs.models import Effect, Job
from jobs.testing import run_worker
from project.payments.jobs import ChargeOrderV1
from project.payments.models import ProviderCharge

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_payment_is_charged_once_and_its_receipt_is_the_result():
    enqueued = jobs.enqueue(ChargeOrderV1(order="order-1", amount_cents=1500))
    run_worker(timeout=20)

    [charge] = ProviderCharge.objects.all()
    job = Job.objects.get(pk=enqueued.id)
    assert job.state == "succeeded" and job.attempts == 1
    assert job.result == {"charge": charge.pk, "order": "order-1", "amount_cents": 1500}
    assert charge.idempotency_key == key_for(job.pk, job.created_at, "charge")


def test_a_lost_answer_is_reconciled_on_the_retry_not_charged_again():
    enqueued = jobs.enqueue(
        ChargeOrderV1(order="order-2", amount_cents=4200, lose_first_response=True)
    )
    run_worker(timeout=20)

    [charge] = ProviderCharge.objects.all()  # once, though the first attempt saw an error
    job = Job.objects.get(pk=enqueued.id)
    assert job.state == "succeeded" and job.attempts == 2
    assert job.result["charge"] == charge.pk
    [effect] = Effect.objects.filter(job=enqueued.id)
    assert effect.state == "done" and effect.result == job.result
