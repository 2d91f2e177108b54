from django.contrib import admin

from jobs.admin import RunTableAdmin
from project.curation.models import CurationRun, Document


@admin.register(Document)
class DocumentAdmin(admin.ModelAdmin):
    """Documents are domain data: fix one that fails a pass, then replay the run."""

    list_display = ("title", "collection", "curated_at")
    list_filter = ("collection",)
    search_fields = ("title",)


@admin.register(CurationRun)
class CurationRunAdmin(RunTableAdmin):
    list_display = ("__str__", "collection", "state", "last_error", "replay_of", "finished_at")
    list_select_related = ("replay_of",)
