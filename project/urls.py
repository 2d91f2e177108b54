from django.conf import settings
from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls)]

if settings.WEB_METRICS:
    # django-prometheus: request, response and database metrics of the web process at
    # /metrics (expose it only to your Prometheus, e.g. with a proxy rule).
    urlpatterns.append(path("", include("django_prometheus.urls")))
