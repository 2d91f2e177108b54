from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # django-prometheus: request, response and database metrics of the web process at
    # /metrics (expose it only to your Prometheus, e.g. with a proxy rule).
    path("", include("django_prometheus.urls")),
]
