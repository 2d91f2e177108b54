from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class MailConfig(AppConfig):
    """Example consumer: outgoing mail, one delivery row per message."""

    name = "project.mail"
    label = "mail"
    verbose_name = _("Mail (example)")
    default_auto_field = "django.db.models.BigAutoField"
