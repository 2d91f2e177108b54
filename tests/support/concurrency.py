"""Sessions on threads of their own, for tests of what concurrent transactions do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connection, connections, transaction

from tests.support.polling import wait_for


class Producer:
    """``work`` inside ``transaction.atomic()`` on a thread of its own, committed when told."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.entered = threading.Event()
        self.go = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Producer:
        self.thread.start()
        assert self.entered.wait(10), "the transaction did not start"
        return self

    def _run(self) -> None:
        try:
            with transaction.atomic():
                self.result = self.work()
                self.entered.set()
                self.go.wait(30)
        except BaseException as exc:  # reported to the test, COMMIT's errors included
            self.error = exc
            self.entered.set()
        finally:
            connections.close_all()

    def finish(self) -> BaseException | None:
        """Commit; the error the work or its COMMIT raised, if any."""
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the transaction did not end"
        return self.error


class InThread:
    """``fn()`` on a thread of its own, started at once; its result or error once joined."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.error: BaseException | None = None
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc
        finally:
            connections.close_all()

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the thread did not finish"


def sessions_waiting_for_locks(text: str = "") -> int:
    """How many sessions of this test database wait for a lock now (those whose query holds
    ``text``); other test processes on the same server have databases of their own."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND query ILIKE %s AND pid <> pg_backend_pid()",
            [f"%{text}%"],
        )
        return cur.fetchone()[0]


def until_waiting(count: int = 1, text: str = "") -> None:
    """Poll until ``count`` sessions wait for a lock (with ``text`` in their query)."""
    wait_for(
        lambda: sessions_waiting_for_locks(text) >= count or None,
        what=f"{count} session(s) waiting for a lock ({text or 'any statement'})",
        interval=0.005,
    )


def run_in_threads(count: int, target: Callable[[int], Any], timeout: float = 30) -> list[Any]:
    """Run ``target(i)`` in ``count`` threads released together; return results in order.

    Each thread uses its own database connection (Django connections are per thread) and
    closes it when done. An exception in any thread is re-raised here.
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait(timeout)
            results[index] = target(index)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a test thread did not finish in time"
    if errors:
        raise errors[0]
    return results


class Background:
    """Run ``target`` in a thread with its own connection; ``result()`` joins and re-raises."""

    def __init__(self, target: Callable[[], Any]):
        self._value: Any = None
        self._error: BaseException | None = None

        def body() -> None:
            try:
                self._value = target()
            except BaseException as exc:  # re-raised by result()
                self._error = exc
            finally:
                connection.close()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 60.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "background thread did not finish in time"
        if self._error is not None:
            raise self._error
        return self._value


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(cur.fetchone()[0])
