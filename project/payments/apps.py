from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class PaymentsConfig(AppConfig):
    """Example consumer: a payment call made exactly once, through an effect key."""

    name = "project.payments"
    label = "payments"
    verbose_name = _("Payments (example)")
    default_auto_field = "django.db.models.BigAutoField"
