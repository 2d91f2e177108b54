"""A stand-in for a payment provider's API: ``charge`` and a lookup by idempotency key.

Its ledger is :class:`~project.payments.models.ProviderCharge`, written in autocommit (the
provider's side commits whatever becomes of the job). ``lose_response`` makes a charge's
response get lost on the way back, as a dropped connection does: the charge is made, the
caller sees an error.
"""

from __future__ import annotations

from typing import TypedDict

from project.payments.models import ProviderCharge


class LostResponse(ConnectionError):
    """The provider made the charge, but its answer never arrived."""


class Receipt(TypedDict):
    charge: int
    order: str
    amount_cents: int


def charge(key: str, *, order: str, amount_cents: int, lose_response: bool = False) -> Receipt:
    made = ProviderCharge.objects.create(
        idempotency_key=key, order=order, amount_cents=amount_cents
    )
    if lose_response:
        raise LostResponse(f"no answer from the provider for charge {key}")
    return _receipt(made)


def find(key: str) -> Receipt | None:
    """The charge made under ``key``, if any (what a reconcile asks the provider)."""
    made = ProviderCharge.objects.filter(idempotency_key=key).order_by("id").first()
    return None if made is None else _receipt(made)


def _receipt(made: ProviderCharge) -> Receipt:
    return {"charge": made.pk, "order": made.order, "amount_cents": made.amount_cents}
