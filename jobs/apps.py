from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = _("Background jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks, import every app's ``jobs.py``, freeze the registry,
        and tell the queue which types drive run rows (it imports nothing above it)."""
        from django.core import checks
        from django.utils.module_loading import autodiscover_modules

        from jobs import checks as jobs_checks
        from jobs.catalogue.registry import catalogue
        from jobs.queue import bound

        checks.register(jobs_checks.check_settings, "jobs")
        checks.register(jobs_checks.check_registry, "jobs")
        autodiscover_modules("jobs")
        registry = catalogue.freeze()
        bound.declare(
            bound.Binding(name, policy.run_model, policy.run_field)
            for name in registry.names()
            if (policy := registry[name].policy).run_model is not None
        )
