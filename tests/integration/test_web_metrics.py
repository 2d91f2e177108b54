"""The web process exports django-prometheus metrics where the web-metrics extra is installed."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db

web_metrics = pytest.mark.skipif(
    find_spec("django_prometheus") is None,
    reason="django-prometheus (the web-metrics extra) is not installed: it supports Django < 6.1",
)


@web_metrics
def test_metrics_endpoint_serves_prometheus_text(client):
    client.get("/admin/login/")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"django_http_requests_total_by_method_total" in response.content


def test_web_metrics_follow_the_extra(client):
    """Installed, the extra is wired in; absent, the project serves the admin without it."""
    assert client.get("/admin/login/").status_code == 200
    installed = find_spec("django_prometheus") is not None
    assert settings.WEB_METRICS is installed
    assert ("django_prometheus" in settings.INSTALLED_APPS) is installed
