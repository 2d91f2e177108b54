from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class CurationConfig(AppConfig):
    """Example consumer: curation passes over a collection, one run row per pass."""

    name = "project.curation"
    label = "curation"
    verbose_name = _("Curation (example)")
    default_auto_field = "django.db.models.BigAutoField"
