"""The schedules page (placeholder: the page is being built)."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib.admin import AdminSite
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.translation import gettext as _


def urls(
    wrap: Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]],
) -> list[URLPattern]:
    """The page's URLs, mounted under the jobs admin."""
    return [path("schedules/", wrap(schedules_page), name="jobs_schedules")]


def schedules_page(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    context = {**site.each_context(request), "title": _("Schedules")}
    return TemplateResponse(request, "admin/jobs/monitor/base.html", context)
