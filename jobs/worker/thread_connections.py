"""The database connections a handler thread has open, asked for only if it opened one.

After every job the worker looks at the thread's Django connections twice: for a transaction
the handler left open (:func:`jobs.worker.execution.close_open_transactions`) and to keep or
close each connection (:meth:`jobs.worker.pool.HandlerPool._recycle`). Listing them costs
about a microsecond each time (Django keeps them in an ``asgiref`` local) where the worker's
whole cost of a no-op job is about 40; a thread whose handlers never touch the database (an
HTTP call, a file) has none to look at. Django announces every connection it opens with
``connection_created``, in the thread that opens it, so a thread that was told it starts with
none knows until then that it has none. Not quite every one: a connection whose set-up fails
after it is made is never announced, so a thread is asked again after any handler that
failed (the failure closes such a connection, as before); and a connection shared between
threads (``inc_thread_sharing``) may be opened by a thread other than its own, so once one
opens every thread is asked, always. Not covered: a connection made and opened in another
thread and then installed in a handler's thread (``connections[alias] = …``) without ever
connecting there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

_state = threading.local()

# Set for good once a connection shared between threads opens: the thread that opens it is
# not always the one whose connection it is, so from then on every thread is asked.
_shared_opened = False


def _opened(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    global _shared_opened
    _state.opened = True
    if connection.allow_thread_sharing:
        _shared_opened = True


connection_created.connect(_opened, dispatch_uid="jobs.worker.thread_connections")


def starts_without_connections() -> None:
    """Note that this thread has no connection open (a new handler thread, or one whose
    connections were all closed). A thread never told so is always asked."""
    _state.opened = False


def may_have_opened() -> None:
    """Ask for this thread's connections next time, announced or not."""
    _state.opened = True


def open_connections() -> Sequence[BaseDatabaseWrapper]:
    """This thread's initialized Django connections (``connections.all(initialized_only=
    True)``), or none at once for a thread that opened none since it started without."""
    if not getattr(_state, "opened", True) and not _shared_opened:
        return []
    return connections.all(initialized_only=True)
