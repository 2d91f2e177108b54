"""The claim's two forms (one ordered scan on PostgreSQL 18+, the priority walk before it)
take the same rows in the same order, for any mix of priorities, due times, tenants and
attempts.

The server in CI is one version; the ``claim_form`` fixture forces the walk by making the
connection report an older one, so both forms run against the same rows.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import queue
from jobs.db.clock import database_now
from jobs.queue import AllTenants, ClaimRequest, NewJob, OnlyTenant

pytestmark = pytest.mark.django_db

NAME = "test.noop.v1"


def test_each_form_is_chosen_by_the_server_version(claim_form):
    sql, _ = queue.claim_sql(AllTenants())

    assert ("WITH RECURSIVE levels" in sql) == (claim_form == "walk")


rows = st.lists(
    st.tuples(
        st.integers(-3, 3),  # priority
        st.integers(-10, 10),  # due in minutes (positive: not due yet)
        st.sampled_from(["t1", "t2"]),  # tenant
        st.integers(0, 3),  # attempts made, of max_attempts 3
    ),
    max_size=25,
)


@given(rows=rows, limit=st.integers(1, 12), only_t1=st.booleans(), cap=st.sampled_from([None, 2]))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_any_backlog_is_claimed_in_priority_then_due_then_id_order(
    claim_form, rows, limit, only_t1, cap
):
    now = database_now()
    with transaction.atomic():
        enqueued = queue.enqueue_many(
            [
                NewJob(
                    name=NAME,
                    payload={},
                    priority=priority,
                    run_after=now + timedelta(minutes=due),
                    tenant=tenant,
                    max_attempts=3,
                )
                for priority, due, tenant, _ in rows
            ]
        )
        ids = [e.id for e in enqueued]
        with connection.cursor() as cur:
            for id_, (*_, attempts) in zip(ids, rows, strict=True):
                cur.execute("UPDATE jobs_job SET attempts = %s WHERE id = %s", [attempts, id_])
        limit_attempts = 3 if cap is None else cap
        expected = [
            id_
            for id_, (priority, due, tenant, attempts) in sorted(
                zip(ids, rows, strict=True), key=lambda pair: (-pair[1][0], pair[1][1], pair[0])
            )
            if due <= 0 and attempts < limit_attempts and (tenant == "t1" or not only_t1)
        ][:limit]

        claimed = queue.claim(
            [ClaimRequest(NAME, limit, max_attempts=cap)],
            scope=OnlyTenant("t1") if only_t1 else AllTenants(),
            worker="w",
        )

        assert [job.id for job in claimed] == expected
        transaction.set_rollback(True)
