"""Every count the console shows says what it counts, and its link lists the rows counted.

Finished jobs leave the jobs table for the history within seconds (the archive pass), so a
count of finished jobs that reads the jobs table alone falls to zero while the failures are
still there to replay.
"""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test import override_settings
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.admin.overview import counted_text
from jobs.db.clock import database_now
from jobs.models import Job, JobHistory, Process
from jobs.queue import AllTenants, ClaimRequest, NewJob, batches, history, processes
from jobs.queue import counts as counting
from jobs.queue._db import load_json
from jobs.queue.counts import Counted
from tests.support.factories import JobFactory

pytestmark = pytest.mark.django_db

OVERVIEW = "admin:jobs_overview"
NAME = "test.noop.v1"  # the factory's job type
TAGS = re.compile(r"<[^>]+>")


def table(markup: str, element_id: str) -> str:
    """The markup of the table with ``element_id``."""
    start = markup.index(f'id="{element_id}"')
    return markup[start : markup.index("</table>", start)]


def rows(markup: str) -> list[str]:
    return re.findall(r"<tr\b.*?</tr>", markup, flags=re.S)


def cells(row: str) -> list[str]:
    """The text of each cell of a table row."""
    found = re.findall(r"<t[hd]\b.*?</t[hd]>", row, flags=re.S)
    return [unescape(TAGS.sub("", cell)).strip() for cell in found]


def links(row: str) -> list[tuple[str, str]]:
    """(href, text) of each link in a table row."""
    found = re.findall(r'<a\b[^>]*href="([^"]*)"[^>]*>(.*?)</a>', row, flags=re.S)
    return [(unescape(href), unescape(TAGS.sub("", text)).strip()) for href, text in found]


def state_row(client, label: str) -> str:
    page = client.get(reverse(OVERVIEW))
    assert page.status_code == 200
    (row,) = [
        r for r in rows(table(page.content.decode(), "jobs-per-state")) if cells(r)[0] == label
    ]
    return row


def listed(client, href: str) -> tuple[set[int], int]:
    """The rows a list link shows (its first page) and the count the list gives."""
    page = client.get(href)
    assert page.status_code == 200, href
    if "cl" in page.context:  # an admin changelist
        return {obj.pk for obj in page.context["cl"].result_list}, page.context["cl"].result_count
    return {row.pk for row in page.context["page"].rows}, page.context["page"].total


def archive() -> dict[str, tuple[int, int]]:
    """The scheduler's archive pass, run as it would two minutes from now."""
    return history.archive(now=database_now() + timedelta(minutes=2))


def test_failed_jobs_moved_to_the_history_are_still_counted_and_listed(admin_client):
    failed = {JobFactory(failed=True).pk for _ in range(6)}
    JobFactory(succeeded=True)
    assert archive()["failed"] == (6, 6)  # all six left the jobs table

    row = state_row(admin_client, "Failed")

    assert cells(row)[-1] == "6", cells(row)  # the state's total, both homes
    seen: set[int] = set()
    for href, text in links(row):
        shown, count = listed(admin_client, href)
        assert count == int(text.replace(",", "")), (href, text, count)
        assert shown <= failed, href  # the list holds what was counted, nothing else
        seen |= shown
    assert seen == failed


def state_cells(client) -> dict[str, list[tuple[str, str]]]:
    """Per state row of "Jobs per state" (and ``all``): its linked counts as (href, text)."""
    page = client.get(reverse(OVERVIEW)).content.decode()
    found = {}
    for row in rows(table(page, "jobs-per-state")):
        state = re.search(r'data-state="([a-z]+)"', row)
        if state:
            found[state[1]] = (links(row), cells(row)[-1])
    return found


def test_every_state_count_opens_a_list_of_exactly_the_rows_it_counts(admin_client):
    for _ in range(3):
        JobFactory(failed=True)
    for _ in range(2):
        JobFactory(succeeded=True, key_held=False)
    JobFactory(state="cancelled", finished_at=database_now(), key_held=False)
    archive()
    JobFactory(failed=True)  # still in the jobs list, holding its key
    JobFactory(succeeded=True)
    JobFactory(running=True)
    JobFactory()
    JobFactory()
    expected = {"queued": 2, "running": 1, "succeeded": 3, "failed": 4, "cancelled": 1, "all": 11}

    found = state_cells(admin_client)

    for state, total in expected.items():
        counted, text = found[state]
        assert text == str(total), state
        listed_rows = 0
        for href, number in counted:
            page = admin_client.get(href)
            result = page.context["cl"]
            assert result.result_count == int(number), (state, href)
            assert state == "all" or {obj.state for obj in result.result_list} <= {state}
            listed_rows += result.result_count
        assert listed_rows == total, state


def test_the_counts_stop_at_their_cap_and_say_what_they_are():
    for _ in range(5):
        JobFactory(failed=True)
    archive()
    for _ in range(5):
        JobFactory(failed=True)

    counts = counting.state_counts(cap=3)

    for home in counting.HOMES:
        past = counts[home, "failed"]
        assert not past.exact and past.n >= 3  # "3+" or PostgreSQL's estimate, never "3"
        assert counted_text(past) in {"3+", f"≈{past.n}"}
    assert counts["jobs", "succeeded"] == Counted(0)
    by_type = counting.failed_by_type(cap=3).of(NAME)
    assert {home: (c.n, c.floor) for home, c in by_type.items()} == {
        "jobs": (4, True),
        "history": (4, True),
    }


def scans(plan: dict) -> list[dict]:
    """Every node of an EXPLAIN (FORMAT JSON) plan that reads a table or an index."""
    found = [plan] if "Relation Name" in plan else []
    for child in plan.get("Plans", ()):
        found += scans(child)
    return found


@pytest.mark.parametrize("statement", [counting.state_counts_sql, counting.failed_by_type_sql])
def test_counting_reads_at_most_the_cap_of_rows_whatever_the_history_holds(statement):
    for state in ("failed", "succeeded"):
        for _ in range(12):
            JobFactory(state=state, finished_at=database_now(), key_held=False)
    archive()
    sql, params = statement(cap=5)

    with connection.cursor() as cur:
        cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        [plan] = load_json(cur.fetchone()[0])

    read = scans(plan["Plan"])
    assert read and all(node["Actual Rows"] * node["Actual Loops"] <= 6 for node in read), read
    assert not [node for node in read if node.get("Rows Removed by Filter")]


def type_row(client, name: str) -> str:
    page = client.get(reverse(OVERVIEW)).content.decode()
    (row,) = [r for r in rows(table(page, "jobs-per-type")) if f'data-type="{name}"' in r]
    return row


def test_a_types_counts_open_the_lists_of_the_rows_they_count(admin_client):
    failed = {JobFactory(failed=True).pk for _ in range(2)}
    archive()
    failed.add(JobFactory(failed=True).pk)
    queued = {JobFactory().pk for _ in range(2)}
    running = {JobFactory(running=True).pk}
    JobFactory(name="other.type.v1", failed=True)

    row = type_row(admin_client, NAME)
    _name, queued_count, due, running_count, failed_count, _registered, *_ = cells(row)
    (queued_link, running_link, failed_link) = [href for href, _text in links(row)[1:4]]

    assert (queued_count, due, running_count, failed_count) == ("2", "2", "1", "3")
    assert listed(admin_client, queued_link) == (queued, 2)
    assert listed(admin_client, running_link) == (running, 1)
    assert listed(admin_client, failed_link) == (failed, 3)  # both homes, in the monitor


def test_an_unsupported_name_links_to_its_queued_jobs(admin_client):
    gone = {JobFactory(name="gone.away.v1").pk for _ in range(2)}
    page = admin_client.get(reverse(OVERVIEW)).content.decode()
    start = page.index('id="unsupported"')
    [(href, text)] = links(page[start : page.index("</ul>", start)])
    assert text == "2" and listed(admin_client, href) == (gone, 2)


def test_the_workers_figures_open_the_processes_they_count(admin_client):
    for identity in ("h:1:ready", "h:2:draining", "h:3:gone"):
        processes.register(
            identity, component="worker", host="h", pid=1, version="1", expires_in=60, concurrency=4
        )
    processes.register(
        "h:4:sched", component="scheduler", host="h", pid=4, version="1", expires_in=60
    )
    Process.objects.filter(identity="h:2:draining").update(draining=True)
    Process.objects.filter(identity="h:3:gone").update(
        expires_at=F("expires_at") - timedelta(hours=1)
    )

    page = admin_client.get(reverse(OVERVIEW)).content.decode()
    figures = {}
    for key in ("workers", "free", "draining"):
        start = page.index(f'id="capacity-{key}"')
        [(href, text)] = links(page[start : page.index("</span>", start + 30)])
        figures[key] = (text, listed(admin_client, href)[0])

    assert figures["workers"][0] == "2 live workers"
    assert (
        {"h:1:ready", "h:2:draining"}
        <= figures["workers"][1]
        <= {
            "h:1:ready",
            "h:2:draining",
            "h:3:gone",  # listed as gone: the list says which are live
        }
    )
    assert figures["free"] == ("4 free slots", {"h:1:ready"})
    assert figures["draining"] == ("1 draining", {"h:2:draining"})


def test_the_finished_chart_counts_attempts_and_says_what_its_lists_no_longer_hold(admin_client):
    hour = admin_client.get(reverse(OVERVIEW)).content.decode()
    week = admin_client.get(reverse(OVERVIEW), {"window": "week"}).content.decode()

    assert "Attempts that ended per minute, by outcome" in hour
    assert "Jobs finished" not in hour  # a retried attempt ends while its job goes on
    assert "no longer listed" not in hour  # every list keeps an hour of finished jobs
    # Succeeded jobs are kept a day (SUCCEEDED_RETENTION): a week of them is not listed.
    assert "(succeeded 1d 00h): older attempts are counted here but no longer listed" in week


def test_a_batchs_members_links_together_list_every_member_wherever_it_is(admin_client):
    batch = batches.open(None, description="three")
    members = {
        e.id for e in batches.add(batch, [NewJob(name=NAME, payload={"i": i}) for i in range(3)])
    }
    batches.seal(batch)
    first, second, _third = queue.claim([ClaimRequest(NAME, 3)], scope=AllTenants())
    queue.complete(first)
    queue.fail(second, code="rejected", detail="no")
    archive()  # the finished members leave the jobs table

    page = admin_client.get(reverse("admin:jobs_batch_change", args=[batch])).content.decode()
    start = page.index(reverse("admin:jobs_job_changelist") + f"?batch={batch}")
    hrefs = [href for href, _text in links(page[page.rindex("<", 0, start) : start + 400])]

    seen = [listed(admin_client, href)[0] for href in hrefs]
    assert len(hrefs) == 2 and set().union(*seen) == members
    assert not seen[0] & seen[1]  # each member on one list


def test_the_performance_page_says_when_its_failures_links_cannot_list_the_whole_window(
    admin_client,
):
    performance = reverse("admin:jobs_performance")
    with override_settings(JOBS={"FAILED_RETENTION": timedelta(days=14)}):
        month = admin_client.get(performance, {"window": "30d"}).content.decode()
        week = admin_client.get(performance, {"window": "week"}).content.decode()

    assert "(failed 14d 00h): older attempts are counted here but no longer listed" in month
    assert 'id="performance-unlisted"' not in week


class Rollback(Exception):
    """Undoes one Hypothesis example's rows."""


homes_and_states = st.fixed_dictionaries(
    {
        (home, state): st.integers(0, 4)
        for home in counting.HOMES
        for state in ("succeeded", "failed", "cancelled")
    }
)


@given(
    seeded=homes_and_states,
    names=st.lists(st.sampled_from(["a.v1", "b.v1", "c.v1"]), min_size=24, max_size=24),
    cap=st.integers(1, 5),
)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_each_count_is_exact_to_its_cap_and_never_more_than_the_rows(seeded, names, cap):
    try:
        with transaction.atomic():
            check_counts(seeded, iter(names), cap)
            raise Rollback
    except Rollback:
        pass


def check_counts(seeded: dict[tuple[str, str], int], names, cap: int) -> None:
    def seed(home: str) -> None:
        for (where, state), n in seeded.items():
            if where == home:
                for _ in range(n):
                    JobFactory(
                        name=next(names),
                        state=state,
                        finished_at=database_now(),
                        key_held=home == "jobs",
                    )

    seed("history")
    archive()
    seed("jobs")
    models = {"jobs": Job, "history": JobHistory}

    counts = counting.state_counts(cap=cap)
    by_type = counting.failed_by_type(cap=cap)

    for (home, state), n in seeded.items():
        assert models[home].objects.filter(state=state).count() == n
        counted = counts[home, state]
        assert counted.exact == (n <= cap) and (counted.n == n if n <= cap else counted.n >= cap)
    for home, model in models.items():
        failed = model.objects.filter(state="failed")
        for name in ("a.v1", "b.v1", "c.v1"):
            true = failed.filter(name=name).count()
            counted = by_type.of(name).get(home, Counted(0))
            assert counted.n == true if counted.exact else counted.n <= true
            assert counted.exact == (failed.count() <= cap)
