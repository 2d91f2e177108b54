from django.contrib import admin

from project.payments.models import ProviderCharge


@admin.register(ProviderCharge)
class ProviderChargeAdmin(admin.ModelAdmin):
    """Read-only: the provider's ledger, to see that each order was charged once."""

    list_display = ("order", "amount_cents", "idempotency_key", "created_at")
    search_fields = ("order", "idempotency_key")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
