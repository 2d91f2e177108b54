"""The ledger of the demo's stand-in payment provider (docs/effects.md's worked example).

A real provider keeps its ledger on its side; the demo keeps it in its own table so the
admin can show that a charge whose response was lost was still made once, not twice.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class ProviderCharge(models.Model):
    """One charge the provider made. Nothing here stops a second charge under the same key:
    the journal (``jobs.effect``) is what does."""

    idempotency_key = models.CharField(_("idempotency key"), max_length=64, db_index=True)
    order = models.CharField(_("order"), max_length=100)
    amount_cents = models.PositiveIntegerField(_("amount (cents)"))
    created_at = models.DateTimeField(_("charged at"), auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = _("provider charge")
        verbose_name_plural = _("provider charges")

    def __str__(self) -> str:
        return f"{self.order}: {self.amount_cents / 100:.2f}"
