"""The admin's database selector: which alias's jobs tables a jobs page shows.

With one alias that holds jobs (:func:`jobs.catalogue.routing.configured`) nothing changes. With
several, the jobs list and the finished jobs list get a *database* filter (the ``database``
query parameter, the home alias when absent), each page says which database it shows, and the
way on keeps the choice: a row's page (through the admin's preserved filters, or
``?database=`` itself), its *Cancel…* view, and the list's actions, which act on that alias.

What the jobs pages link to elsewhere (replay through the failure monitor, the run row a job
drives, its batch and dependencies) reads Django's ``default`` alias, so on another alias it is
left out rather than shown wrong.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.db import DEFAULT_DB_ALIAS
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, QueryDict
from django.utils.http import urlencode
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from jobs.admin.modeladmin import RunTableAdmin
from jobs.catalogue import routing as databases
from jobs.control.links import Link

#: The query parameter that names the alias.
PARAM = "database"


def chosen(request: HttpRequest) -> str:
    """The alias the request asks for (``database``, also inside preserved filters); the
    home alias when it names none, or one that holds no jobs."""
    value = request.GET.get(PARAM)
    if value is None and (preserved := request.GET.get("_changelist_filters")):
        value = QueryDict(preserved).get(PARAM)
    return value if value in databases.configured() else databases.home()


def several() -> bool:
    """Whether more than one alias holds jobs, so the pages offer a choice."""
    return len(databases.configured()) > 1


def query(alias: str) -> str:
    """``?database=…`` for links to a row of ``alias`` (empty for the home alias)."""
    return "" if alias == databases.home() else "?" + urlencode({PARAM: alias})


def shown(alias: str) -> str:
    """What a page says about the database it shows."""
    return gettext("Database: %(alias)s") % {"alias": alias}


class DatabaseFilter(admin.SimpleListFilter):
    """The alias to list; the admin's queryset does the routing, so this only offers it."""

    title = _("database")
    parameter_name = PARAM

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(alias, alias) for alias in databases.configured()]

    def has_output(self) -> bool:
        return several()

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset

    def choices(self, changelist: ChangeList) -> Any:
        """One choice per alias (no "All": one list reads one database), the page reset."""
        current = self.value() if self.value() in databases.configured() else databases.home()
        for value, label in self.lookup_choices:
            yield {
                "selected": value == current,
                "query_string": changelist.get_query_string({PARAM: value}, [PAGE_VAR]),
                "display": label,
            }


class DatabaseRunTableAdmin(RunTableAdmin):
    """A run-table admin of the jobs app's own tables, which every jobs alias has."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).using(chosen(request))

    def get_preserved_filters(self, request: HttpRequest) -> str:
        """The list's filters every link of a page carries (its way back, History, the
        save's redirect), naming the chosen alias even when the page was reached by
        ``?database=`` itself: a row id means another row in another database."""
        preserved = super().get_preserved_filters(request)
        alias = chosen(request)
        if alias == databases.home():
            return preserved
        filters = QueryDict(QueryDict(preserved).get("_changelist_filters", ""), mutable=True)
        if filters.get(PARAM) == alias:
            return preserved
        filters[PARAM] = alias
        return urlencode({"_changelist_filters": filters.urlencode()})

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        if several():
            extra["subtitle"] = shown(chosen(request))
        return super().changelist_view(request, extra)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        if several():
            extra["database_shown"] = shown(chosen(request))
        return super().change_view(request, object_id, form_url, extra)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        """Replay goes through the failure monitor, which reads the home alias."""
        actions = super().get_actions(request)
        if chosen(request) != DEFAULT_DB_ALIAS:
            actions.pop("replay_selected", None)
        return actions

    def replay_url(self, request: HttpRequest, object_id: str) -> str | None:
        if chosen(request) != DEFAULT_DB_ALIAS:
            return None
        return super().replay_url(request, object_id)

    def linked(self, request: HttpRequest, object_id: str) -> Link | None:
        if chosen(request) != DEFAULT_DB_ALIAS:
            return None
        return super().linked(request, object_id)
