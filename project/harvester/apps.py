from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class HarvesterConfig(AppConfig):
    """Example consumer: harvests items from sources; failed items go to a dead-letter table."""

    name = "project.harvester"
    label = "harvester"
    verbose_name = _("Harvester (example)")
    default_auto_field = "django.db.models.BigAutoField"
