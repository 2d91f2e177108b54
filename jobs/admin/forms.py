"""The monitor's filters, read from the query string, and the links that change one of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django import forms
from django.http import QueryDict
from django.utils.translation import gettext_lazy as _

from jobs.control.inputs import validate_text
from jobs.control.tables import AGES, Filters, RunTable
from jobs.runs import ErrorCode, RunState

ALL_STATES = "all"
FILTER_KEYS = ("module", "state", "job_type", "tenant", "error", "age", "q")


class FilterForm(forms.Form):
    """Validates the query string; an invalid value is ignored rather than an error page."""

    module = forms.ChoiceField(required=False)
    state = forms.ChoiceField(
        required=False, choices=[*RunState.choices, (ALL_STATES, _("All states"))]
    )
    job_type = forms.CharField(required=False, max_length=200, validators=[validate_text])
    tenant = forms.CharField(required=False, max_length=64, validators=[validate_text])
    error = forms.ChoiceField(required=False, choices=[("", _("Any")), *ErrorCode.choices])
    age = forms.ChoiceField(
        required=False, choices=[("", _("Any time"))] + [(k, v[1]) for k, v in AGES.items()]
    )
    q = forms.CharField(required=False, max_length=255, validators=[validate_text])

    def __init__(self, data: QueryDict, tables: Sequence[RunTable]) -> None:
        super().__init__(data)
        module = self.fields["module"]
        assert isinstance(module, forms.ChoiceField)  # declared above
        module.choices = [("", _("All"))] + [(t.label, t.label) for t in tables]

    def filters(self) -> Filters:
        """The filters to apply: the valid values, defaults for the rest (state: failed)."""
        self.is_valid()
        data = self.cleaned_data
        state = data.get("state") or RunState.FAILED
        return Filters(
            module=data.get("module", ""),
            state="" if state == ALL_STATES else state,
            job_type=data.get("job_type", "").strip(),
            tenant=data.get("tenant", "").strip(),
            error=data.get("error", ""),
            age=AGES[data["age"]][0] if data.get("age") else None,
            q=data.get("q", "").strip(),
        )


def filter_query(data: QueryDict) -> QueryDict:
    """Only the filter parameters of a query string (no page number, no replay fields)."""
    query = QueryDict(mutable=True)
    for key in FILTER_KEYS:
        if value := data.get(key):
            query[key] = value
    return query


def with_param(data: QueryDict, key: str, value: str) -> str:
    """The query string with one filter set (or removed when ``value`` is empty)."""
    query = filter_query(data)
    if value:
        query[key] = value
    else:
        query.pop(key, None)
    encoded = query.urlencode()
    return f"?{encoded}" if encoded else "?"


def link_filters(
    data: QueryDict, tables: Sequence[RunTable], job_types: Sequence[str]
) -> list[dict[str, Any]]:
    """The sidebar: per filter, its choices as links, the selected one marked."""
    groups: list[tuple[str, Any, list[tuple[str, Any]]]] = [
        ("module", _("module"), [("", _("All"))] + [(t.label, t.label) for t in tables]),
        ("state", _("state"), _states()),
        ("error", _("error"), [("", _("Any")), *ErrorCode.choices]),
        ("age", _("age"), [("", _("Any time"))] + [(k, v[1]) for k, v in AGES.items()]),
        ("job_type", _("job type"), [("", _("All"))] + [(n, n) for n in job_types]),
    ]
    result = []
    for key, title, choices in groups:
        current = data.get(key, "")
        if key == "state" and current == RunState.FAILED:
            current = ""  # the default, however it is spelled
        result.append(
            {
                "key": key,
                "title": title,
                "choices": [
                    {
                        "display": display,
                        "url": with_param(data, key, value),
                        "selected": current == value,
                    }
                    for value, display in choices
                ],
            }
        )
    return result


def _states() -> list[tuple[str, Any]]:
    """Failed first and by default (it is a failure monitor), then the rest, then all."""
    rest = [(value, label) for value, label in RunState.choices if value != RunState.FAILED]
    return [("", _("Failed")), *rest, (ALL_STATES, _("All states"))]
