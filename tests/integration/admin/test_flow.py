"""The admin's flow-control page and the tenant weights admin, with limits really in force.

Jobs are enqueued and claimed through the queue with the types' flow controls, so the running
jobs, the emptied buckets and the throttle the page reads are the ones the claim and the
worker write. The page's registry is the test's own (:func:`flow_registry`), so the other
tests' job types stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs import Payload, Policy, queue
from jobs.admin import flow as page
from jobs.catalogue.registry import JobType, Registry
from jobs.models import TenantWeight
from jobs.queue import flow
from tests.support.admin import client_for, operator
from tests.support.dom import Elements
from tests.support.flow import (
    FAIR,
    GATED,
    PER_TENANT,
    PLAIN,
    RATED,
    enqueue,
    flow_registry,
    handler,
    limits_of,
    seed_limits_in_force,
)

pytestmark = pytest.mark.django_db

PAGE = reverse("admin:jobs_flow")
WEIGHTS = reverse("admin:jobs_tenantweight_changelist")
ADD_WEIGHT = reverse("admin:jobs_tenantweight_add")


@pytest.fixture
def registry(monkeypatch) -> Iterator[Registry]:
    registry = flow_registry()
    monkeypatch.setattr(page, "get_registry", lambda: registry)
    yield registry


def rows(markup: str) -> dict[str, dict[str, str]]:
    return {row["data-type"]: row for row in Elements(markup).select("tr") if "data-type" in row}


def tenants_of(markup: str, name: str) -> dict[str, dict[str, str]]:
    """The tenant rows of one type's table (each table follows its ``data-tenants-of``)."""
    found: dict[str, dict[str, str]] = {}
    current = None
    for tag, attrs, _charts in Elements(markup).found:
        if tag == "div" and "data-tenants-of" in attrs:
            current = attrs["data-tenants-of"]
        elif tag == "tr" and "data-tenant" in attrs and current == name:
            found[attrs["data-tenant"]] = attrs
    return found


def test_the_page_shows_each_limit_in_force_and_why_it_holds_jobs_back(registry):
    seed_limits_in_force(registry)
    viewer = operator("viewer", "jobs.view_job")

    response = client_for(viewer).get(PAGE)

    assert response.status_code == 200
    markup = response.content.decode()
    found = rows(markup)
    assert set(found) == {GATED, RATED, FAIR, PER_TENANT, PLAIN}
    gated = found[GATED]
    assert (gated["data-running"], gated["data-limit"], gated["data-due"]) == ("2", "2", "3")
    assert gated["data-limiting"] == "global" and gated["data-held"] == "3"
    rated = found[RATED]
    assert rated["data-limiting"] == "rate" and rated["data-held"] == "2"
    assert "1/min, burst 1" in markup
    assert found[FAIR]["data-limiting"] == ""  # due jobs, and room for them
    per_tenant = found[PER_TENANT]
    assert per_tenant["data-limiting"] == "tenant"
    assert (per_tenant["data-due"], per_tenant["data-held"]) == ("4", "3")  # cyan has room
    plain = found[PLAIN]
    assert plain["data-limiting"] == "throttle" and plain["data-held"] == "4"
    assert "429 Too Many Requests" in markup and "throttled by job plain-7" in markup

    fair = tenants_of(markup, FAIR)
    assert {t: (r["data-due"], r["data-weight"]) for t, r in fair.items()} == {
        "acme": ("6", "3"),
        "bolt": ("2", "1"),
    }
    assert float(fair["acme"]["data-share"]) == pytest.approx(0.75)
    assert float(fair["bolt"]["data-share"]) == pytest.approx(0.25)
    per = tenants_of(markup, PER_TENANT)
    assert {t: (r["data-due"], r["data-running"]) for t, r in per.items()} == {
        "acme": ("2", "1"),
        "bolt": ("1", "1"),
        "cyan": ("1", "0"),
    }
    assert float(per["cyan"]["data-share"]) == 1.0  # the only tenant that can start now
    assert float(per["acme"]["data-share"]) == 0.0
    # Viewing jobs is not editing weights.
    assert 'jobs-weight-edit"' not in markup and 'id="flow-weights-link"' not in markup


def test_the_page_needs_the_jobs_view_permission_and_edits_need_the_weights_one(registry):
    seed_limits_in_force(registry)
    assert client_for(operator("nobody")).get(PAGE).status_code == 403
    assert client_for(operator("outsider", staff=False)).get(PAGE).status_code == 302

    editor = operator("editor", "jobs.view_job", "jobs.change_tenantweight")
    markup = client_for(editor).get(PAGE).content.decode()

    acme = reverse("admin:jobs_tenantweight_change", args=["acme"])
    assert f'href="{acme}" class="jobs-weight-edit"' in markup  # a row: its change page
    assert f"{ADD_WEIGHT}?tenant=bolt" in markup  # no row yet: the add form, prefilled
    assert 'id="flow-weights-link"' in markup


def test_the_page_is_a_fixed_number_of_queries_however_many_tenants(registry):
    flow.ensure(limits_of(registry))
    viewer = client_for(operator("viewer", "jobs.view_job"))
    enqueue(FAIR, 1, "t-0")
    viewer.get(PAGE)  # the session and permission caches are warm from here on

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert viewer.get(PAGE).status_code == 200
        return len(queries)

    few = count()
    for n in range(1, 40):
        enqueue(FAIR, 1, f"t-{n}")
        TenantWeight.objects.create(tenant=f"t-{n}", weight=2)
    assert count() == few
    markup = viewer.get(PAGE).content.decode()
    assert len(tenants_of(markup, FAIR)) == page.TENANT_ROWS  # the top tenants, bounded
    assert "tenants with the most due jobs" in markup


def test_nothing_to_show_says_so(monkeypatch):
    monkeypatch.setattr(page, "get_registry", lambda: Registry([]))
    markup = client_for(operator("viewer", "jobs.view_job")).get(PAGE).content.decode()
    assert 'id="flow-none"' in markup


def test_a_share_kept_for_lower_priorities_is_said(monkeypatch):
    class LowerV1(Payload, name="flowpage.lower.v1"):
        n: int = 0

    registry = Registry([JobType(LowerV1, handler, Policy(lower_priority_share=0.2))])
    monkeypatch.setattr(page, "get_registry", lambda: registry)

    markup = client_for(operator("viewer", "jobs.view_job")).get(PAGE).content.decode()

    assert rows(markup)["flowpage.lower.v1"]["data-limiting"] == ""
    assert "lower priorities keep 20% of each claim" in markup


def test_an_ended_throttle_is_no_longer_shown(registry):
    flow.ensure(limits_of(registry))
    queue.throttle(PLAIN, 0.0, reason="over already")
    enqueue(PLAIN, 1)

    data = page.flow_data(registry=registry)

    assert PLAIN not in {row["name"] for row in data["types"]}


def test_the_overview_and_the_app_page_link_to_it():
    viewer = client_for(operator("viewer", "jobs.view_job"))
    assert PAGE in viewer.get(reverse("admin:jobs_overview")).content.decode()
    assert PAGE in viewer.get(reverse("admin:app_list", args=["jobs"])).content.decode()
    assert PAGE in viewer.get(reverse("admin:jobs_job_changelist")).content.decode()


def test_the_overview_marks_a_throttled_type_and_forgets_an_ended_throttle():
    viewer = client_for(operator("viewer", "jobs.view_job"))
    queue.throttle("jobapp.ping.v1", 600, reason="throttled by job p-1: slow down")
    queue.throttle("jobapp.audit.v1", 0.0, reason="over")

    markup = viewer.get(reverse("admin:jobs_overview")).content.decode()

    found = rows(markup)
    assert "jobs-throttled" in found["jobapp.ping.v1"].get("class", "")
    assert "jobs-paused" not in found["jobapp.audit.v1"].get("class", "")
    assert "throttled by job p-1: slow down" in markup
    assert Elements(markup).select("tr", data_pause="job_type:jobapp.ping.v1")
    assert not Elements(markup).select("tr", data_pause="job_type:jobapp.audit.v1")


# Tenant weights ------------------------------------------------------------------------------


def test_a_weight_set_changed_and_reset_is_logged_each_time():
    editor = operator("editor", "jobs.view_tenantweight", "jobs.change_tenantweight")
    client = client_for(editor)

    form = client.get(f"{ADD_WEIGHT}?tenant=acme").content.decode()
    assert 'value="acme"' in form  # prefilled from the flow page's link
    response = client.post(ADD_WEIGHT, {"tenant": "acme", "weight": "3"})
    assert response.status_code == 302
    assert TenantWeight.objects.get(tenant="acme").weight == 3
    change = reverse("admin:jobs_tenantweight_change", args=["acme"])
    assert client.post(change, {"weight": "5"}).status_code == 302
    assert TenantWeight.objects.get(tenant="acme").weight == 5
    delete = reverse("admin:jobs_tenantweight_delete", args=["acme"])
    assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not TenantWeight.objects.exists()

    entries = list(LogEntry.objects.order_by("pk"))
    assert [(e.action_flag, e.user.username, e.object_id) for e in entries] == [
        (ADDITION, "editor", "acme"),
        (CHANGE, "editor", "acme"),
        (DELETION, "editor", "acme"),
    ]
    assert entries[0].change_message == "Set weight 3 via the admin (was 1, the default)"
    assert entries[1].change_message == "Changed weight from 3 to 5 via the admin"


def test_the_list_edits_weights_in_place_and_logs_each_change():
    TenantWeight.objects.create(tenant="acme", weight=2)
    TenantWeight.objects.create(tenant="bolt", weight=1)
    client = client_for(operator("editor", "jobs.change_tenantweight"))

    response = client.post(
        WEIGHTS,
        {
            "form-TOTAL_FORMS": "2",
            "form-INITIAL_FORMS": "2",
            "form-0-tenant": "acme",
            "form-0-weight": "4",
            "form-1-tenant": "bolt",
            "form-1-weight": "1",
            "_save": "Save",
        },
    )

    assert response.status_code == 302
    assert dict(TenantWeight.objects.values_list("tenant", "weight")) == {"acme": 4, "bolt": 1}
    entry = LogEntry.objects.get()  # bolt did not change: no entry
    assert (entry.object_id, entry.action_flag) == ("acme", CHANGE)
    assert entry.change_message == "Changed weight from 2 to 4 via the admin"


def test_weights_outside_their_bounds_and_bad_tenant_names_are_refused():
    client = client_for(operator("editor", "jobs.change_tenantweight"))
    for weight in ("0", "1001", "-3"):
        response = client.post(ADD_WEIGHT, {"tenant": "acme", "weight": weight})
        assert response.status_code == 200 and response.context["adminform"].form.errors
    response = client.post(ADD_WEIGHT, {"tenant": "acme corp", "weight": "2"})
    assert "tenant" in response.context["adminform"].form.errors
    assert not TenantWeight.objects.exists() and not LogEntry.objects.exists()


def test_viewing_weights_is_not_changing_them():
    TenantWeight.objects.create(tenant="acme", weight=2)
    viewer = client_for(operator("viewer", "jobs.view_tenantweight"))
    change = reverse("admin:jobs_tenantweight_change", args=["acme"])

    assert viewer.get(WEIGHTS).status_code == 200
    assert viewer.post(change, {"weight": "9"}).status_code == 403
    assert viewer.post(ADD_WEIGHT, {"tenant": "bolt", "weight": "2"}).status_code == 403
    delete = reverse("admin:jobs_tenantweight_delete", args=["acme"])
    assert viewer.post(delete, {"post": "yes"}).status_code == 403
    assert TenantWeight.objects.get().weight == 2 and not LogEntry.objects.exists()
    assert client_for(operator("nobody")).get(WEIGHTS).status_code == 403


def test_a_saved_tenant_stays_its_own():
    TenantWeight.objects.create(tenant="acme", weight=2)
    client = client_for(operator("editor", "jobs.change_tenantweight"))
    change = reverse("admin:jobs_tenantweight_change", args=["acme"])

    client.post(change, {"tenant": "bolt", "weight": "3"})

    assert dict(TenantWeight.objects.values_list("tenant", "weight")) == {"acme": 3}


def test_a_live_refresh_renders_the_same_page(registry):
    seed_limits_in_force(registry)
    viewer = client_for(operator("viewer", "jobs.view_job"))

    response = viewer.get(PAGE, headers={"X-Jobs-Live": "1"})

    assert response.status_code == 200 and "X-Jobs-Live" in response["Vary"]
    assert set(rows(response.content.decode())) == {GATED, RATED, FAIR, PER_TENANT, PLAIN}
