"""Generated job ids: version 7 UUIDs, so keyless jobs' keys land in time order.

A random (version 4) key put every insert at a random place in the key lock index
(``tenant, job_id``): on a large table each enqueue touched a page of its own, and after a
checkpoint wrote all of it to the WAL again. A time-ordered key goes where the last one went.
"""

from __future__ import annotations

import os
import time
import uuid

from jobs.models import new_job_id, new_job_ids


def test_a_generated_job_id_is_a_version_7_uuid_of_its_millisecond():
    before = time.time_ns() // 1_000_000
    job_id = new_job_id()
    after = time.time_ns() // 1_000_000

    parsed = uuid.UUID(hex=job_id)
    assert job_id == parsed.hex  # 32 lowercase hex digits, no dashes
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert before <= parsed.int >> 80 <= after


def test_ids_of_later_milliseconds_sort_after_earlier_ones():
    earlier = [new_job_id() for _ in range(50)]
    deadline = time.monotonic() + 1
    start = int(earlier[-1][:12], 16)
    while time.time_ns() // 1_000_000 <= start:  # the next millisecond
        assert time.monotonic() < deadline
    later = [new_job_id() for _ in range(50)]
    assert max(earlier) < min(later)


def test_generated_ids_do_not_repeat():
    drawn = [new_job_id() for _ in range(200_000)]
    assert len(set(drawn)) == len(drawn)


def test_a_batch_of_ids_is_version_7_uuids_of_its_millisecond_none_repeated():
    before = time.time_ns() // 1_000_000
    batches = [new_job_ids(count) for count in (0, 1, 2, 1_000, 20_000)]
    after = time.time_ns() // 1_000_000

    assert [len(ids) for ids in batches] == [0, 1, 2, 1_000, 20_000]
    drawn = [job_id for ids in batches for job_id in ids]
    assert len(set(drawn)) == len(drawn)
    for job_id in drawn:
        parsed = uuid.UUID(hex=job_id)
        assert job_id == parsed.hex
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert before <= parsed.int >> 80 <= after


def test_a_batch_of_ids_reads_the_systems_random_bytes_once(monkeypatch):
    # One system call a batch, not one an id: it was a third of drawing an id.
    calls = []
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: calls.append(n) or real(n))

    ids = new_job_ids(500)

    assert calls == [500 * 10] and len(set(ids)) == 500
