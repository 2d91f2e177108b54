"""Enqueueing in tests: the columns an enqueue writes, the transactions it opens, and
batches forced onto the INSERT statement instead of COPY."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection

# What must match between the paths; times are compared as offsets from created_at.
COLUMNS = (
    "name",
    "payload",
    "tenant",
    "queue",
    "priority",
    "max_attempts",
    "state",
    "attempts",
    "last_error",
    "error_detail",
    "claimed_by",
    "key_held",
    "keyed",
    "replayed_by",
    "fair",
    "batch_id",
    "waiting_on",
    "attempt_log",
    "cancel_requested_by",
    "depended_on",
)


class TransactionControl:
    """Counts the transactions Django opens on the connection (atomic() turns autocommit off)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.begun = 0
        real = connection.set_autocommit

        def counting(autocommit: bool, *args, **kwargs):
            if not autocommit:
                self.begun += 1
            return real(autocommit, *args, **kwargs)

        monkeypatch.setattr(connection, "set_autocommit", counting)


enqueue_module = importlib.import_module("jobs.queue.enqueue")


def inserted_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches go in by the INSERT statement, not COPY: it writes rows in key order (random
    for keyless jobs), so the first jobs claimed lie on a page each, and a read that steps over
    them stands out by hundreds of pages (COPY packs them on a few dozen)."""
    monkeypatch.setattr(enqueue_module, "COPY_AT_LEAST", 10**9)
