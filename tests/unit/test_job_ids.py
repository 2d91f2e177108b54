"""Generated job ids: version 7 UUIDs, so keyless jobs' keys land in time order.

A random (version 4) key put every insert at a random place in the key lock index
(``tenant, job_id``): on a large table each enqueue touched a page of its own, and after a
checkpoint wrote all of it to the WAL again. A time-ordered key goes where the last one went.
"""

from __future__ import annotations

import time
import uuid

from jobs.models import new_job_id


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
