"""The per-type performance page (placeholder: the page is being built)."""

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
    return [path("performance/", wrap(performance_page), name="jobs_performance")]


def performance_page(request: HttpRequest, *, site: AdminSite) -> HttpResponse:
    context = {**site.each_context(request), "title": _("Performance by job type")}
    return TemplateResponse(request, "admin/jobs/monitor/base.html", context)
