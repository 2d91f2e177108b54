from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from jobs.admin import RunTableAdmin
from project.mail.models import Delivery


@admin.register(Delivery)
class DeliveryAdmin(RunTableAdmin):
    list_display = ("subject", "to", "status", "job_id", "attempts", "resends", "last_error")
    search_fields = ("job_id", "to")

    @admin.display(description=_("status"), ordering="state")
    def status(self, obj: Delivery) -> str:
        return obj.status
