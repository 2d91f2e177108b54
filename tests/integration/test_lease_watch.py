"""A renewal that hangs on a silent network path: the handler is still told to stop in time.

The lease keeper's connection goes through a TCP proxy that stops forwarding (``freeze``):
no answer comes and no TCP timeout fires, so the renewal call hangs. A lease that runs out
meanwhile lets another worker take the job, so its handler must be told to stop by then,
whatever the call is doing, and the keeper must renew again once the path is back.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections

from jobs import queue
from jobs.queue import ClaimRequest, NewJob
from jobs.queue.types import AllTenants
from jobs.worker.execution import Running, make_context
from jobs.worker.leases import LeaseKeeper
from tests.support.polling import wait_for
from tests.support.tcp_proxy import TcpProxy
from tests.support.worker import Echo, Recorder, registry

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = 1.0


def claim_one() -> Running:
    queue.enqueue(NewJob(Echo.job_name, {"text": "x"}))
    [job] = queue.claim(
        [ClaimRequest(Echo.job_name, 1)], scope=AllTenants(), lease=timedelta(seconds=LEASE)
    )
    job_type = registry(Recorder())[Echo.job_name]
    return Running(job, job_type, make_context(job, job_type))


def lease_left(running: Running) -> float:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM lease_expires_at - statement_timestamp()) "
            "FROM jobs_job WHERE id = %s",
            [running.job.id],
        )
        return float(cur.fetchone()[0])


def test_a_hanging_renewal_still_stops_the_handler_within_its_lease(caplog):
    running = claim_one()
    held = [running]
    shared = connections.settings[DEFAULT_DB_ALIAS]  # new connections of every thread
    saved = {key: shared.get(key) for key in ("HOST", "PORT")}
    with TcpProxy() as proxy:
        connections[DEFAULT_DB_ALIAS].close()
        shared.update(HOST="127.0.0.1", PORT=str(proxy.port))
        keeper = LeaseKeeper(lambda: list(held), lease_seconds=LEASE, tick=0.02)
        try:
            keeper.start()  # its connection goes through the proxy; this thread's will not
            renewed = running.leased_at
            wait_for(lambda: running.leased_at > renewed, timeout=5, what="a first renewal")
        finally:
            shared.update(saved)
        with caplog.at_level(logging.WARNING, logger="jobs.worker"):
            proxy.freeze()  # every call of the keeper hangs from now on
            wait_for(running.ctx.cancelled.is_set, timeout=5, what="the handler told to stop")
            stopped = time.monotonic() - running.leased_at  # since its last renewal began
            assert running.lost, "no outcome will be written"
            # The hanging call is abandoned too, so the keeper can renew once the path is back.
            wait_for(lambda: "lease renewal of" in caplog.text, timeout=5, what="call aborted")

        proxy.thaw()
        fresh = claim_one()
        held.append(fresh)
        renewed = fresh.leased_at
        try:
            wait_for(lambda: fresh.leased_at > renewed, timeout=5, what="renewing again")
        finally:
            keeper.stop()
    # When its lease could end on the server (a lease after its last renewal began), give or
    # take a tick and this test's polling.
    assert stopped < LEASE + 0.25, stopped
    assert "lost the lease of job" in caplog.text
    assert lease_left(fresh) > 0
