"""A read-only ModelAdmin for run tables, with replay through the monitor's confirmation.

Domain apps register their run tables with :class:`RunTableAdmin` (the jobs admin builds on
it too). Rows are never edited, added or deleted in the admin: their state belongs to the
module that owns the table. Replay is the one deliberate action, and it goes through the
same confirmation page, permission and record as the failure monitor.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.contrib import admin
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.core.paginator import Paginator
from django.db import models
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _

from jobs.admin.display import moment, now_of, with_now
from jobs.admin.inputs import CheckedInputs
from jobs.admin.views import confirmation
from jobs.control.failures import MAX_ROWS
from jobs.control.links import Link, link_of
from jobs.control.replays import REPLAY_ALL_LIMIT
from jobs.control.tables import RunTable, visible_tables
from jobs.runs import RunContract

# The contract's own columns; a table may drop some of them (``attempts = None``).
CONTRACT_FIELDS = frozenset(f.name for f in RunContract._meta.local_fields)


# django-stubs declare Paginator and ModelAdmin generic; Django's own classes take no type
# arguments at run time, so the subclasses below leave them out.
class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """Counts at most ``MAX_ROWS`` rows, so a list over a huge table never counts all of it."""

    object_list: QuerySet[Any]  # the admin paginates its changelist's queryset

    @cached_property
    def count(self) -> int:
        return self.object_list.order_by()[:MAX_ROWS].count()


class InputFilter(admin.SimpleListFilter):
    """A free-text filter (``tenant``, ``queue``): no ``SELECT DISTINCT`` over the table."""

    template = "admin/jobs/input_filter.html"
    parameter_name: str  # set by each subclass, as SimpleListFilter requires
    field_name = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return []

    def has_output(self) -> bool:
        return True

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = (self.value() or "").strip()
        return queryset.filter(**{self.field_name: value}) if value else queryset

    def choices(self, changelist: ChangeList) -> Any:
        keep = {
            key: value
            for key, value in changelist.params.items()
            if key not in (self.parameter_name, PAGE_VAR)
        }
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": _("All"),
            "hidden": sorted(keep.items()),
            "value": self.value() or "",
            "name": self.parameter_name,
        }


def column(model: type[models.Model], name: Any, clip: bool = False) -> Any:
    """The list column for ``name``, written the console's way; anything else as it is.

    A ``DateTimeField`` is written by :func:`~jobs.admin.display.moment` (to the second,
    zone, age); with ``clip``, a text field is cut to its column's width by CSS, its whole
    value in the title. The column keeps the field's name (its CSS class), label and sorting.
    Cached, so that ``list_display_links`` can name the same column object.
    """
    if not isinstance(name, str):
        return name
    key = (model, name, clip)
    if key not in _COLUMNS:
        _COLUMNS[key] = _column(model, name, clip)
    return _COLUMNS[key]


_COLUMNS: dict[tuple[type[models.Model], str, bool], Any] = {}


def _column(model: type[models.Model], name: str, clip: bool) -> Any:
    try:
        field = model._meta.get_field(name)
    except FieldDoesNotExist:
        return name
    if isinstance(field, models.DateTimeField):

        def show(obj: Any) -> str:
            return moment(getattr(obj, name), now_of(obj))

    elif clip and isinstance(field, models.CharField):

        def show(obj: Any) -> str:
            value = getattr(obj, name)
            if not value:
                return "—"
            return format_html('<span class="jobs-clip" title="{}">{}</span>', value, value)

    else:
        return name
    show.__name__ = name
    return admin.display(description=field.verbose_name, ordering=name)(show)


class ConsoleColumns:
    """List columns the console's way (:func:`column`): timestamps with zone and age, long
    names in ``clipped`` cut to their width; ``list_display_links`` follow the columns."""

    model: Any  # set by ModelAdmin
    #: Columns whose long values are cut to the column's width, whole in their title.
    clipped: ClassVar[frozenset[str]] = frozenset({"job_id", "name", "tenant", "queue"})

    def console_columns(self, names: Any) -> list[Any]:
        return [column(self.model, name, name in self.clipped) for name in names]

    def get_list_display(self, request: HttpRequest) -> Any:
        return self.console_columns(super().get_list_display(request))  # type: ignore[misc]

    def get_list_display_links(self, request: HttpRequest, list_display: Any) -> Any:
        links = super().get_list_display_links(request, list_display)  # type: ignore[misc]
        return self.console_columns(links) if links else links


class RunTableAdmin(CheckedInputs, ConsoleColumns, admin.ModelAdmin):  # type: ignore[type-arg]
    """Read-only list and detail of a run table; replay for users with its permission."""

    # Declared as wide as ModelAdmin's, so that subclasses may list other columns and filters.
    list_display: list[Any] | tuple[Any, ...] = (
        "__str__",
        "job_id",
        "state",
        "attempts",
        "last_error",
        "created_at",
    )
    list_filter: ClassVar[list[Any] | tuple[Any, ...]] = ("state", "last_error")
    search_fields = ("job_id",)
    ordering = ("-pk",)
    actions = ["replay_selected"]
    paginator = CappedPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    change_form_template = "admin/jobs/runtable/change_form.html"

    @cached_property
    def run_table(self) -> RunTable:
        return RunTable(self.model)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The rows with PostgreSQL's "now", which the timestamp columns age them by."""
        return with_now(super().get_queryset(request))

    def get_list_display(self, request: HttpRequest) -> Any:
        """Leave out run-contract columns this table dropped (``attempts = None``)."""
        fields = self.run_table.fields
        return self.console_columns(
            name
            for name in admin.ModelAdmin.get_list_display(self, request)
            if not isinstance(name, str) or name in fields or name not in CONTRACT_FIELDS
        )

    def get_list_filter(self, request: HttpRequest) -> Any:
        fields = self.run_table.fields
        return [
            f for f in super().get_list_filter(request) if not isinstance(f, str) or f in fields
        ]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return self.run_table.can_replay(request.user)

    @admin.action(permissions=["replay"], description=_("Replay selected failed rows…"))
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse:
        """Show the monitor's replay confirmation for the selected rows (at most 500).

        Over "select all" that is the newest 500 eligible rows of the filtered list, and the
        page says how many match, as "replay all matching" does on the monitor.
        """
        table, back = self.run_table, request.get_full_path()
        if request.POST.get("select_across") != "1":
            pks = list(queryset.order_by("-pk").values_list("pk", flat=True)[:REPLAY_ALL_LIMIT])
            return confirmation(request, self.admin_site, {table: pks}, back)
        eligible = queryset.filter(self.model.replay_eligible())
        pks = list(eligible.order_by("-pk").values_list("pk", flat=True)[:REPLAY_ALL_LIMIT])
        matching = len(pks)
        if matching >= REPLAY_ALL_LIMIT:
            matching = table.count(eligible, MAX_ROWS)
        shown = [
            (k, v) for k, v in request.GET.items() if k not in (PAGE_VAR, "_changelist_filters")
        ]
        return confirmation(
            request,
            self.admin_site,
            {table: pks},
            back,
            matching=matching,
            capped=matching >= MAX_ROWS,
            limit=REPLAY_ALL_LIMIT,
            filters=", ".join(f"{key}={value}" for key, value in shown) or str(_("none")),
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        extra["replay_url"] = self.replay_url(request, object_id)
        extra["replay_description"] = self.run_table.replay_description
        extra["linked"] = self.linked(request, object_id)
        extra["is_jobs"] = self.run_table.is_jobs
        return super().change_view(request, object_id, form_url, extra)

    def linked(self, request: HttpRequest, object_id: str) -> Link | None:
        """The other home of this row's work (its job, or the run row the job drives)."""
        try:
            pk = self.run_table.to_pk(object_id)
        except ValidationError:  # a malformed id: the change view answers it
            return None
        return link_of(self.run_table, pk, visible_tables(request.user))

    def replay_url(self, request: HttpRequest, object_id: str) -> str | None:
        """The confirmation URL for replaying this row, if it is eligible and allowed."""
        if not self.has_replay_permission(request):
            return None
        table = self.run_table
        try:
            pk = table.to_pk(object_id)
        except ValidationError:  # a malformed id: the change view answers it
            return None
        if not table.eligible_pks([pk]):
            return None
        base = reverse(f"{self.admin_site.name}:jobs_monitor_replay")
        return f"{base}?{urlencode({'rows': f'{table.label}:{pk}', 'next': request.path})}"
