"""The web process exports django-prometheus metrics."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_metrics_endpoint_serves_prometheus_text(client):
    client.get("/admin/login/")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"django_http_requests_total_by_method_total" in response.content
