from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = _("Background jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks, import every app's ``jobs.py``, freeze the registry."""
        from django.core import checks
        from django.utils.module_loading import autodiscover_modules

        from jobs import checks as jobs_checks
        from jobs.catalogue.registry import catalogue

        checks.register(jobs_checks.check_settings, "jobs")
        checks.register(jobs_checks.check_registry, "jobs")
        autodiscover_modules("jobs")
        catalogue.freeze()
