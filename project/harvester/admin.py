from django.contrib import admin

from jobs.admin import RunTableAdmin
from project.harvester.models import DeadLetter, Item


@admin.register(Item)
class ItemAdmin(admin.ModelAdmin):
    """Items are domain data: fix a bad URL here, then re-pick its dead letter."""

    list_display = ("url", "title", "harvested_at")
    search_fields = ("url", "title")


@admin.register(DeadLetter)
class DeadLetterAdmin(RunTableAdmin):
    list_display = ("item", "job_id", "state", "attempts", "last_error", "finished_at")
    list_select_related = ("item",)
