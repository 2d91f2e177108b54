"""Whatever an operator types reaches the database checked: never a server error, never a
traceback.

PostgreSQL refuses text holding a NUL character or a lone surrogate, and a statement carrying
one fails. Every admin list filter, search, form field and object id of the console, and every
argument of ``manage.py replay`` and ``manage.py jobs``, is checked first: a filter no row can
match shows no rows and says why, a form says what is wrong with the field, and a command ends
with a ``CommandError`` naming the argument. The property tests send generated text (NUL, lone
surrogates, very long strings, huge numbers, any code point) through each of them.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from io import StringIO
from urllib.parse import quote

import pytest
from django.contrib import admin
from django.contrib.admin.views.main import ORDER_VAR, PAGE_VAR, SEARCH_VAR
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import Client, RequestFactory, override_settings
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.admin.databases import DatabaseRunTableAdmin
from jobs.admin.modeladmin import RunTableAdmin
from jobs.models import Job, Pause
from jobs.queue import AllTenants, ClaimRequest, NewJob, processes
from tests.support.admin import client_for, operator
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

SCHEDULES = {
    "nightly": {"cron": "0 3 * * *", "job": "jobapp.ping.v1", "payload": {"message": "tick"}}
}
NUL, SURROGATE = "a\x00b", "x\udcffy"
#: Values every surface gets, one parameter at a time, besides the generated ones.
KNOWN = (NUL, SURROGATE, "é" * 3000, "9" * 30, "-" + "9" * 30)
HOSTILE = st.one_of(
    st.sampled_from(KNOWN),
    st.text(st.characters(exclude_categories=()), max_size=24),  # NUL and surrogates included
    st.text(st.characters(exclude_categories=()), min_size=1, max_size=4).map(lambda s: s * 700),
    st.integers(-(10**25), 10**25).map(str),
)
FORM = "application/x-www-form-urlencoded"
QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def encoded(params: Mapping[str, str]) -> str:
    """A form body or query string as a hostile client sends it: a lone surrogate goes as the
    bytes that encode it (which are not UTF-8), a NUL as ``%00``."""
    return "&".join(
        f"{quote(key)}={quote(value, safe='', errors='surrogatepass')}"
        for key, value in params.items()
    )


def isolated[T](act: Callable[[], T]) -> T:
    """Run one request or command in a savepoint rolled back after it: examples stay apart."""
    with transaction.atomic():
        result = act()
        transaction.set_rollback(True)
    return result


def get(client: Client, path: str, params: Mapping[str, str]) -> int:
    return isolated(lambda: client.get(f"{path}?{encoded(params)}").status_code)


def post(client: Client, path: str, params: Mapping[str, str]) -> int:
    body = encoded(params)
    return isolated(lambda: client.post(path, body, content_type=FORM).status_code)


@pytest.fixture
def superuser() -> User:
    """``root``, to whom every page, control and command of the console is open."""
    return User.objects.create_superuser("root")


@pytest.fixture
def root(superuser: User) -> Client:
    return client_for(superuser)


@pytest.fixture(autouse=True)
def configured():
    with override_settings(JOBS={"SCHEDULES": SCHEDULES}):
        yield


def console_admins() -> list[str]:
    """Every ModelAdmin of the console (the jobs app's and each run table's), by model label."""
    return sorted(
        model._meta.label_lower
        for model, model_admin in admin.site._registry.items()
        if model._meta.app_label == "jobs" or isinstance(model_admin, RunTableAdmin)
    )


def admin_of(label: str) -> admin.ModelAdmin:  # type: ignore[type-arg]
    return next(ma for m, ma in admin.site._registry.items() if m._meta.label_lower == label)


@functools.cache
def list_parameters(label: str) -> list[str]:
    """The query parameters a list reads: its filters' (however they are declared), its
    search, ordering and page, its date drill-down, and what the console's links add."""
    model_admin = admin_of(label)
    request = RequestFactory().get("/")
    request.user = User(username="probe", is_active=True, is_staff=True, is_superuser=True)
    changelist = model_admin.get_changelist_instance(request)
    names = {name for spec in changelist.filter_specs for name in spec.expected_parameters()}
    names |= {ORDER_VAR, PAGE_VAR} | ({SEARCH_VAR} if model_admin.search_fields else set())
    if field := model_admin.date_hierarchy:
        names |= {f"{field}__year", f"{field}__month", f"{field}__day"}
    if isinstance(model_admin, DatabaseRunTableAdmin):
        names |= {"database", "batch" if label == "jobs.job" else "batch_id"}
    return sorted(names)


def list_url(label: str) -> str:
    app, model = label.split(".")
    return reverse(f"admin:{app}_{model}_changelist")


def one_at_a_time(names: list[str]) -> Iterator[dict[str, str]]:
    for name in names:
        for value in KNOWN:
            yield {name: value}


def answered(status: int) -> bool:
    """An answer that is not a server error (a page, a redirect, a refusal, a 404)."""
    return status < 500


# The cases found first, named. ----------------------------------------------------------------


@pytest.mark.parametrize("label", ["jobs.job", "jobs.jobhistory"])
@pytest.mark.parametrize("param", ["tenant", "queue", "name"])
def test_a_nul_in_the_jobs_lists_own_filters_matches_no_job_and_says_why(root, label, param):
    JobFactory(tenant="acme", queue="default", name="test.noop.v1")

    page = root.get(f"{list_url(label)}?{encoded({param: 'acme' + chr(0)})}")

    assert page.status_code == 200
    assert page.context["cl"].result_count == 0
    [message] = [str(m) for m in get_messages(page.wsgi_request)]
    assert re.search(rf"{param}.*contains a NUL character", message)


def test_a_nul_in_a_schedule_pause_reason_is_a_form_error(root):
    url = reverse("admin:jobs_schedule_pause", args=["nightly"])

    page = root.post(url, encoded({"post": "yes", "reason": NUL}), content_type=FORM)

    assert page.status_code == 200
    assert "contains a NUL character" in page.content.decode()
    assert not Pause.objects.exists()


def test_an_action_whose_selection_names_no_row_does_nothing_and_says_so(root):
    queued = JobFactory()
    body = encoded({"action": "cancel_selected", "_selected_action": "abc", "post": "yes"})

    page = root.post(list_url("jobs.job"), body, content_type=FORM, follow=True)

    assert page.status_code == 200
    assert [str(m) for m in get_messages(page.wsgi_request)] == [
        "The selection names something that is not a row here: nothing was done."
    ]
    assert Job.objects.get(pk=queued.pk).state == "queued"


@pytest.fixture
def alice() -> User:
    return operator(
        "alice",
        "jobs.view_job",
        "jobs.replay_job",
        "jobs.cancel_job",
        "jobs.pause_work",
        "jobs.run_schedule",
    )


@pytest.mark.parametrize("value", [NUL, SURROGATE])
@pytest.mark.parametrize(
    "argv,named",
    [
        (["replay", "--all", "--user", "alice", "--tenant", "{}"], "--tenant"),
        (["replay", "--all", "--user", "alice", "--job-type", "{}"], "--job-type"),
        (["replay", "--all", "--user", "alice", "--job-id", "{}"], "--job-id"),
        (["replay", "--all", "--user", "alice", "--error", "{}"], "--error"),
        (["replay", "1", "--user", "{}"], "--user"),
        (["jobs", "cancel", "--all", "--user", "alice", "--tenant", "{}"], "--tenant"),
        (["jobs", "cancel", "--all", "--user", "alice", "--queue", "{}"], "--queue"),
        (["jobs", "cancel", "--all", "--user", "alice", "--job-type", "{}"], "--job-type"),
        (["jobs", "cancel", "1", "--user", "{}"], "--user"),
        (["jobs", "pause", "queue", "q", "--user", "alice", "--reason", "{}"], "--reason"),
        (["jobs", "pause", "job_type", "{}", "--user", "alice"], "name"),
        (["jobs", "resume", "queue", "{}", "--user", "alice"], "name"),
        (["jobs", "resume", "job_type", "{}", "--user", "alice"], "name"),
    ],
)
def test_text_the_database_cannot_hold_is_a_command_error_naming_the_argument(
    alice, argv, named, value
):
    JobFactory(failed=True, tenant="acme")

    with pytest.raises(CommandError, match=rf"^{re.escape(named)} contains a "):
        call_command(*[value if part == "{}" else part for part in argv], stdout=StringIO())

    assert not Pause.objects.exists()
    assert Job.objects.get().state == "failed"


# Any value, everywhere. -----------------------------------------------------------------------

PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=QUIET)


@pytest.mark.parametrize("label", console_admins())
def test_every_list_parameter_alone_with_each_known_hostile_value(root, label):
    url = list_url(label)
    JobFactory()
    for params in one_at_a_time(list_parameters(label)):
        assert answered(get(root, url, params)), params


@pytest.mark.parametrize("label", console_admins())
@PROPERTY
@given(data=st.data())
def test_no_list_fails_whatever_its_filters_search_order_and_page(root, label, data):
    names = list_parameters(label)
    params = data.draw(st.dictionaries(st.sampled_from(names), HOSTILE, min_size=1, max_size=3))
    assert answered(get(root, list_url(label), params)), params


# Pages of the console besides the lists: (url name, url args, what it reads, a valid base).
PAGES: dict[str, tuple[str, list[str], list[str], dict[str, str]]] = {
    "monitor": (
        "admin:jobs_monitor",
        [],
        ["module", "state", "job_type", "tenant", "error", "age", "q", "p"],
        {},
    ),
    "groups": ("admin:jobs_monitor_groups", [], ["module", "state"], {}),
    "replay all": (
        "admin:jobs_monitor_replay",
        [],
        ["module", "state", "job_type", "tenant", "error", "age", "q", "next", "rows"],
        {"all": "1"},
    ),
    "replay rows": ("admin:jobs_monitor_replay", [], ["rows", "next"], {}),
    "overview": ("admin:jobs_overview", [], ["window", "state"], {}),
    "performance": ("admin:jobs_performance", [], ["window", "sort"], {}),
    "flow": ("admin:jobs_flow", [], ["window", "tenant"], {}),
    "schedules": ("admin:jobs_schedules", [], ["schedule"], {}),
    "pause form": (
        "admin:jobs_pause_add",
        [],
        ["kind", "value", "reason", "next"],
        {"kind": "queue", "value": "bulk"},
    ),
    "run now": ("admin:jobs_schedule_run", ["nightly"], ["next"], {}),
}
# Forms and confirmations, posted: (url name, url args, what it reads, a valid base).
POSTS: dict[str, tuple[str, list[str], list[str], dict[str, str]]] = {
    "pause": (
        "admin:jobs_pause_add",
        [],
        ["kind", "value", "reason", "next", "post"],
        {"kind": "queue", "value": "bulk", "post": "yes"},
    ),
    "schedule pause": (
        "admin:jobs_schedule_pause",
        ["nightly"],
        ["reason", "next", "post"],
        {"post": "yes"},
    ),
    "schedule resume": ("admin:jobs_schedule_resume", ["nightly"], ["next"], {"post": "yes"}),
    "run now": ("admin:jobs_schedule_run", ["nightly"], ["token", "next"], {"post": "yes"}),
    "replay": (
        "admin:jobs_monitor_replay",
        [],
        ["rows", "next", "all", "tenant", "q"],
        {"confirm": "yes"},
    ),
    "tenant override": (
        "admin:jobs_tenantoverride_add",
        [],
        ["tenant", "component", "note"],
        {"tenant": "acme", "component": "worker"},
    ),
    "tenant weight": (
        "admin:jobs_tenantweight_add",
        [],
        ["tenant", "weight"],
        {"tenant": "acme", "weight": "2"},
    ),
}
ACTIONS = {
    "jobs.job": ["replay_selected", "cancel_selected", "run_now_selected"],
    "jobs.jobhistory": ["replay_selected"],
    "jobs.pause": ["resume_selected"],
    "mail.delivery": ["replay_selected"],
}
for label, names in ACTIONS.items():
    for action in names:
        POSTS[f"{label} {action}"] = (
            f"admin:{label.replace('.', '_')}_changelist",
            [],
            ["_selected_action", "action", "select_across", "index", "post"],
            {"action": action, "index": "0"},
        )


@pytest.fixture
def rows() -> dict[str, str]:
    """One row of each kind the object pages name, by kind: their ids fill the bases."""
    queue.enqueue(NewJob("jobapp.ping.v1", job_id="held"))
    processes.register("w1:1:aa", component="worker", host="w1", pid=1, version="1", expires_in=60)
    [claimed] = queue.claim(
        [ClaimRequest("jobapp.ping.v1", 1)], scope=AllTenants(), worker="w1:1:aa"
    )
    queue.pause("queue", "bulk", by="root")
    return {
        "job": str(claimed.id),
        "failed": str(JobFactory(failed=True).pk),
        "pause": str(Pause.objects.get().pk),
        "process": "w1:1:aa",
    }


def page_url(name: str, args: list[str]) -> str:
    return reverse(name, args=args)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_page_parameter_alone_with_each_known_hostile_value(root, rows, page):
    name, args, names, base = PAGES[page]
    for params in one_at_a_time(names):
        assert answered(get(root, page_url(name, args), {**base, **params})), params


@pytest.mark.parametrize("page", sorted(PAGES))
@PROPERTY
@given(data=st.data())
def test_no_page_fails_whatever_its_query(root, rows, page, data):
    name, args, names, base = PAGES[page]
    params = data.draw(st.dictionaries(st.sampled_from(names), HOSTILE, min_size=1, max_size=3))
    assert answered(get(root, page_url(name, args), {**base, **params})), params


def post_base(form: str, rows: dict[str, str]) -> dict[str, str]:
    base = dict(POSTS[form][3])
    if "_selected_action" in POSTS[form][2]:
        base["_selected_action"] = rows["pause" if form.startswith("jobs.pause") else "failed"]
    return base


@pytest.mark.parametrize("form", sorted(POSTS))
def test_every_posted_field_alone_with_each_known_hostile_value(root, rows, form):
    name, args, names, _base = POSTS[form]
    for params in one_at_a_time(names):
        assert answered(post(root, page_url(name, args), {**post_base(form, rows), **params}))


@pytest.mark.parametrize("form", sorted(POSTS))
@PROPERTY
@given(data=st.data())
def test_no_form_or_confirmation_fails_whatever_is_posted(root, rows, form, data):
    name, args, names, _base = POSTS[form]
    params = data.draw(st.dictionaries(st.sampled_from(names), HOSTILE, min_size=1, max_size=3))
    assert answered(post(root, page_url(name, args), {**post_base(form, rows), **params}))


# Pages of one object, by the id in their path.
OBJECT_PAGES = [
    "admin:jobs_job_change",
    "admin:jobs_job_cancel",
    "admin:jobs_jobhistory_change",
    "admin:jobs_process_change",
    "admin:jobs_batch_change",
    "admin:jobs_pause_resume",
    "admin:jobs_pause_delete",
    "admin:jobs_tenantoverride_change",
    "admin:jobs_tenantweight_change",
    "admin:mail_delivery_change",
    "admin:jobs_schedule_run",
    "admin:jobs_schedule_pause",
    "admin:jobs_schedule_resume",
]


def object_url(name: str, raw: str) -> str:
    """The page of the object ``raw`` names, its id in the path as a hostile client sends it."""
    placeholder = reverse(name, args=["PLACEHOLDER"])
    return placeholder.replace("PLACEHOLDER", quote(raw, safe="", errors="surrogatepass"))


@pytest.mark.parametrize("name", OBJECT_PAGES)
@PROPERTY
@given(raw=HOSTILE.filter(bool))
def test_no_object_page_fails_whatever_its_id(root, name, raw):
    url = object_url(name, raw)
    assert answered(isolated(lambda: root.get(url).status_code)), url
    body = encoded({"post": "yes"})
    assert answered(isolated(lambda: root.post(url, body, content_type=FORM).status_code)), url


# Every argument of the operator commands: "{}" is the generated value.
COMMANDS = [
    ["replay", "{}", "--user", "root"],
    ["replay", "{}", "{}", "--user", "root", "--dry-run"],
    ["replay", "{}", "--user", "root", "--model", "mail.delivery"],
    ["replay", "1", "--user", "{}"],
    ["replay", "--all", "--user", "root", "--model", "{}"],
    ["replay", "--all", "--user", "root", "--limit", "{}"],
    ["replay", "--all", "--user", "root", "--age", "{}"],
    ["replay", "--all", "--user", "root", "--job-type", "{}", "--tenant", "{}"],
    ["replay", "--all", "--user", "root", "--error", "{}", "--job-id", "{}"],
    ["replay", "--all", "--user", "root", "--job-id", "{}", "--dry-run"],
    ["jobs", "pause", "queue", "{}", "--user", "root", "--reason", "{}"],
    ["jobs", "pause", "tenant", "{}", "--user", "root"],
    ["jobs", "pause", "job_type", "{}", "--user", "root"],
    ["jobs", "pause", "schedule", "{}", "--user", "root"],
    ["jobs", "pause", "{}", "q", "--user", "root"],
    ["jobs", "pause", "queue", "q", "--user", "{}"],
    ["jobs", "resume", "queue", "{}", "--user", "root"],
    ["jobs", "resume", "tenant", "{}", "--user", "root"],
    ["jobs", "resume", "job_type", "{}", "--user", "root"],
    ["jobs", "resume", "schedule", "{}", "--user", "root"],
    ["jobs", "cancel", "{}", "--user", "root"],
    ["jobs", "cancel", "{}", "{}", "--user", "root", "--dry-run"],
    ["jobs", "cancel", "1", "--user", "{}"],
    ["jobs", "cancel", "--all", "--user", "root", "--job-type", "{}", "--tenant", "{}"],
    ["jobs", "cancel", "--all", "--user", "root", "--queue", "{}", "--dry-run"],
    ["jobs", "cancel", "--all", "--user", "root", "--state", "{}"],
    ["jobs", "cancel", "--all", "--user", "root", "--limit", "{}"],
    ["jobs", "run-now", "{}", "--user", "root"],
    ["jobs", "run-now", "nightly", "--user", "{}"],
    ["jobs", "--database", "{}", "paused"],
    ["jobs", "{}"],
]


def command(argv: list[str], values: list[str]) -> None:
    """Run ``argv`` with ``values`` in its holes: only a CommandError may come out of it."""
    given = iter(values)
    args = [next(given) if part == "{}" else part for part in argv]
    with contextlib.suppress(CommandError):
        isolated(lambda: call_command(*args, stdout=StringIO(), stderr=StringIO()))


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_argument_with_each_known_hostile_value(superuser, argv):
    JobFactory(failed=True)
    holes = argv.count("{}")
    for value in KNOWN:
        command(argv, [value] * holes)


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
@PROPERTY
@given(data=st.data())
def test_no_command_ends_in_a_traceback_whatever_its_arguments(superuser, argv, data):
    holes = argv.count("{}")
    command(argv, data.draw(st.lists(HOSTILE, min_size=holes, max_size=holes)))
