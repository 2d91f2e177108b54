"""What a database error means, read from its SQLSTATE: refused data, a conflict, an outage.

Judged by SQLSTATE, never by exception class: psycopg files a lock timeout (55P03), a
statement timeout (57014) and a lost connection alike under ``OperationalError``, and the
worker and the scheduler must tell them apart (a refused outcome fails its job; contention
defers it; an unreachable database waits for the database).
"""

from __future__ import annotations

from django.db import Error as DjangoDbError

# SQLSTATEs that mean the server or the path to it is gone, not that a statement was refused:
# connection exceptions (class 08) and the server shutting down or crashing (57P01-57P03).
_UNREACHABLE = ("08", "57P01", "57P02", "57P03")
# SQLSTATEs that refuse the data itself: data exceptions (class 22), integrity constraint
# violations (class 23), a program limit the data passes (class 54: an index row over its
# size, say), and what a PL/pgSQL trigger raises by default (P0001).
_DATA_ERRORS = ("22", "23", "54", "P0001")


def _sqlstate(exc: BaseException) -> str | None:
    cause = exc.__cause__ if isinstance(exc, DjangoDbError) else exc
    sqlstate = getattr(cause, "sqlstate", None)
    return sqlstate or None


def refused_data(exc: BaseException) -> bool:
    """True when the database refused a statement's data: the only database error that may
    turn an outcome into a failure.

    Judged by SQLSTATE, not by exception class: psycopg files a lock timeout (55P03) or a
    statement timeout (57014) under OperationalError, as it does a lost connection, and
    those are contention or an outage, not a verdict on the data.
    """
    sqlstate = _sqlstate(exc)
    return sqlstate is not None and sqlstate.startswith(_DATA_ERRORS)


#: SQLSTATEs of a transaction PostgreSQL rolled back for a conflict with another one (a
#: serialization failure, a deadlock): the same statement succeeds when tried again.
_TRANSIENT = ("40001", "40P01")


def transient(exc: BaseException) -> bool:
    """True for a statement aborted by a conflict with another transaction (try it again)."""
    return _sqlstate(exc) in _TRANSIENT


def unreachable(exc: BaseException) -> bool:
    """A database error that says the database cannot be reached (retry the whole pass):
    no SQLSTATE at all (a failed connect, a broken socket), or one of the connection's end."""
    if not isinstance(exc, DjangoDbError):
        return False
    sqlstate = _sqlstate(exc)
    return sqlstate is None or sqlstate.startswith(_UNREACHABLE)


def one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
