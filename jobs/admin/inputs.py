"""The console's lists and object pages, safe from any value in the query string or the path.

Each ModelAdmin of the console (the jobs app's, and every run table's through
:class:`~jobs.admin.modeladmin.RunTableAdmin`) takes :class:`CheckedInputs`, which checks
what Django's admin would otherwise hand straight to the database
(:mod:`jobs.control.inputs` says why PostgreSQL refuses some text):

* a list filter (``?tenant=``, ``?state__exact=``, any declared filter) whose value no row
  can hold matches no row: the list is empty and says why, as Django's own search says
  what is wrong with a search;
* a date drill-down too far out to be a date is an invalid lookup, as a malformed one is;
* an object id in the path that no row can have is a row that does not exist;
* an action's selection that names something other than a row of the list does nothing
  and says so.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.translation import gettext

from jobs.control.inputs import first_refusal, refusal


class CheckedChangeList(ChangeList):
    """A changelist that sends the database only filter values it can take."""

    _said = False

    def get_filters(self, request: HttpRequest) -> Any:
        try:
            return super().get_filters(request)
        except OverflowError as exc:  # a year like 10**20 in the date drill-down
            raise IncorrectLookupParameters(exc) from exc

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        found = first_refusal(self.get_filters_params())
        if found is None:
            return queryset
        if not self._said:  # the list may ask for its rows more than once per request
            self._said = True
            name, why = found
            messages.warning(
                request,
                gettext("No row matches the filter %(name)s: its value %(why)s.")
                % {"name": name, "why": why},
            )
        return queryset.none()


class CheckedInputs:
    """A ModelAdmin mixin: lists, object pages and actions checked as the module says."""

    model: Any  # set by ModelAdmin

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CheckedChangeList

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        if refusal(object_id) is not None:
            return None  # no row has it: the page says the object does not exist
        return super().get_object(request, object_id, from_field)  # type: ignore[misc]

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run the chosen action, unless the selection names something that is no row id.

        Django 6.1 passes where the action was chosen (``action_location``): passed on.
        """
        selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        if not all(self._is_pk(value) for value in selected):
            messages.warning(
                request,
                gettext("The selection names something that is not a row here: nothing was done."),
            )
            return HttpResponseRedirect(request.get_full_path())
        response: HttpResponse | None = super().response_action(  # type: ignore[misc]
            request, queryset, *args, **kwargs
        )
        return response

    def _is_pk(self, value: str) -> bool:
        if refusal(value) is not None:
            return False
        try:
            self.model._meta.pk.to_python(value)
        except ValidationError:
            return False
        return True
