"""Which Django database alias holds which jobs: routing for enqueue, workers and the scheduler.

A job type may live in a database of its own (``@job(Report, database="reports")``)::

    enqueue(Report(...))  ──▶ the type's alias, in that alias's transaction
    runworker --database reports  ──▶ claims there: the types bound to it and the unbound ones
    runscheduler  ──▶ one leader (on JOBS["DATABASE"]); its duties visit every configured alias
    admin  ──▶ a database selector over the same aliases

A type that names no database is *unbound*: its jobs go to ``JOBS["DATABASE"]`` unless enqueue
names another alias with ``using=``, and every worker runs it wherever it finds it (the task
backend's ``django.task.v1`` is such a type: its ``DATABASE`` option picks the alias). A
*bound* type's jobs go to its alias only: enqueueing one elsewhere is refused, since no worker
there would run it. Django's ``DATABASE_ROUTERS`` play no part in any of this; a router that
keeps the jobs app off an alias (``allow_migrate``) keeps its tables off it too, and the
watchdog scans a run table only on the aliases the routers let it migrate to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, connections

from jobs.catalogue.registry import catalogue
from jobs.core.conf import jobs_settings
from jobs.db import bounds as dbbounds
from jobs.db.sessions import owns_its_session

if TYPE_CHECKING:
    from jobs.catalogue.registry import Registry

#: The task backend whose ``OPTIONS["DATABASE"]`` names an alias that holds jobs.
TASK_BACKEND = "jobs.backends.PostgresBackend"


def home() -> str:
    """``JOBS["DATABASE"]``: where unbound jobs go, and where the scheduler leads from."""
    return str(jobs_settings.DATABASE)


def bound(name: str) -> str | None:
    """The alias the registered type ``name`` is bound to; None: unbound or not registered."""
    if not catalogue.frozen:
        return None
    job_type = catalogue.get().get(name)
    return None if job_type is None else job_type.policy.database


def configured() -> tuple[str, ...]:
    """Every alias that holds jobs tables, the home alias first (``JOBS["DATABASES"]``).

    Unset, it is the home alias, each alias a registered job type is bound to, and the
    ``DATABASE`` of each task backend of this app, in that order.
    """
    listed = jobs_settings.DATABASES
    if listed is not None:
        return _unique([home(), *listed]) if home() in listed else _unique(listed)
    return _unique([home(), *_bound_aliases(), *_task_aliases()])


def route(jobs: Sequence[tuple[int | None, str]], using: str | None) -> str:
    """The one alias a batch of ``(index, name)`` jobs goes to; raises ``InvalidJob``.

    Without ``using`` each job goes to its type's alias (unbound: the home alias), and a
    batch whose jobs would go to different aliases is refused: one batch is one transaction,
    and a transaction has one database. With ``using``, a job of a type bound elsewhere is
    refused: no worker of ``using`` would ever run it.
    """
    from jobs.queue.types import InvalidJob

    # One lookup a type, not a job; each type's first job is the one an error names.
    first_of: dict[str, int | None] = {}
    for index, name in jobs:
        first_of.setdefault(name, index)
    bound_to = {name: bound(name) for name in first_of}
    if using is not None:
        for name, index in first_of.items():
            alias = bound_to[name]
            if alias is not None and alias != using:
                raise InvalidJob(
                    f"{name} lives in database {alias!r} (its job type says so); it cannot "
                    f"be enqueued in {using!r}, where no worker runs it",
                    index=index,
                )
        return using
    first: dict[str, tuple[int | None, str]] = {}
    for name, index in first_of.items():
        first.setdefault(bound_to[name] or home(), (index, name))
    if len(first) > 1:
        where = "; ".join(f"job #{i} ({name}) to {alias!r}" for alias, (i, name) in first.items())
        raise InvalidJob(
            f"a batch must go to one database, but its jobs go to several: {where}. "
            "Enqueue each database's jobs on their own, or pass using= for unbound types"
        )
    return next(iter(first), home())


def served(registry: Registry, alias: str) -> tuple[str, ...]:
    """The names a worker on ``alias`` claims: types bound to it and every unbound type."""
    return tuple(t.name for t in registry if t.policy.database in (None, alias))


def bound_elsewhere(registry: Registry, alias: str) -> tuple[str, ...]:
    """The registered names bound to an alias other than ``alias``."""
    return tuple(t.name for t in registry if t.policy.database not in (None, alias))


def unapplied_migrations(alias: str) -> list[str] | None:
    """The jobs migrations ``alias``'s database has not recorded, in order (``None``: it has
    no jobs tables at all). A worker on an older schema would fail on every claim that uses
    what a newer migration made (the fair pick function, for one), not once at start.

    Asked on a connection with the worker's bounds (:mod:`jobs.db.bounds`): a server that
    accepts connections but never answers makes this raise, not hang.
    """
    from django.db.migrations.loader import MigrationLoader

    on_disk = sorted(
        name
        for app, name in MigrationLoader(None, ignore_no_migrations=True).disk_migrations
        if app == "jobs"
    )
    with dbbounds.bounded(connections[alias]) as db, db.cursor() as cur:
        cur.execute("SELECT to_regclass('jobs_job'), to_regclass('django_migrations')")
        row = cur.fetchone()
        if not (row and row[0]):
            return None
        if not row[1]:
            return on_disk
        cur.execute("SELECT name FROM django_migrations WHERE app = 'jobs'")
        recorded = {name for (name,) in cur.fetchall()}
    return [name for name in on_disk if name not in recorded]


def problems(alias: str) -> list[str]:
    """Why a worker cannot serve ``alias`` (empty: it can). Reads the database last."""
    if alias not in settings.DATABASES:
        return [
            f"database {alias!r} is not an alias of settings.DATABASES "
            f"({', '.join(settings.DATABASES)})"
        ]
    if alias not in configured():
        return [
            f"database {alias!r} is not one of the aliases that hold jobs "
            f"({', '.join(configured())}): add it to JOBS['DATABASES'] so that the "
            "scheduler maintains it and the admin shows it"
        ]
    try:
        missing = unapplied_migrations(alias)
    except DatabaseError:
        return []  # unreachable now: a worker starts anyway and retries until it is back
    if missing is None:
        return [f"database {alias!r} has no jobs tables: run manage.py migrate --database {alias}"]
    if missing:
        return [
            f"database {alias!r} lacks jobs migrations {', '.join(missing)}: "
            f"run manage.py migrate --database {alias}"
        ]
    return []


#: What to do when ``JOBS["PREPARED_STATEMENTS"]`` is on behind a pooler (``jobs.W030``).
POOLER_HINT = (
    "A pooler in transaction mode lends each transaction any server connection, where a "
    "statement prepared on another is missing. Keep the setting on only if the pooler keeps "
    "prepared statements (PgBouncer 1.21 or later with max_prepared_statements above 0), then "
    "silence jobs.W030; otherwise turn it off."
)


def behind_a_pooler(alias: str) -> str | None:
    """Why the queue's prepared statements may fail on ``alias``: ``JOBS["PREPARED_STATEMENTS"]``
    is on and its connection goes through a pooler, which answers the start-up with a backend
    pid of its own (the listener's test). None when the setting is off, the connection is
    direct, or the database cannot be reached now. The pid cannot tell a PgBouncer that keeps
    prepared statements from one that does not: the caller warns, and never refuses.
    """
    conn = connections[alias]
    if jobs_settings.PREPARED_STATEMENTS is not True or conn.vendor != "postgresql":
        return None
    try:
        conn.ensure_connection()
        if owns_its_session(conn.connection):
            return None
    except DatabaseError:
        return None  # unreachable: Django's checks and the worker's retries report it
    return (
        f"JOBS['PREPARED_STATEMENTS'] is on, and the database {alias!r} is reached through a "
        f"connection pooler."
    )


def check_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``jobs.E040``/``E041``: the jobs aliases (``JOBS["DATABASE"]``, each task backend's
    ``DATABASE``, ``JOBS["DATABASES"]``) are Django aliases, and every one is listed."""
    user = getattr(settings, "JOBS", None) or {}
    if not isinstance(user, dict):
        return []  # jobs.E007
    aliases = set(settings.DATABASES)
    errors: list[CheckMessage] = []
    database = user.get("DATABASE", "default")
    if not isinstance(database, str) or database not in aliases:
        errors.append(
            Error(
                f"JOBS['DATABASE'] must be an alias of settings.DATABASES, got {database!r}.",
                hint=f"Configured aliases: {', '.join(sorted(aliases))}.",
                id="jobs.E040",
            )
        )
    for name, options in (getattr(settings, "TASKS", None) or {}).items():
        if not isinstance(options, dict) or options.get("BACKEND") != TASK_BACKEND:
            continue
        alias = (options.get("OPTIONS") or {}).get("DATABASE")
        if alias is not None and (not isinstance(alias, str) or alias not in aliases):
            errors.append(
                Error(
                    f"TASKS[{name!r}]['OPTIONS']['DATABASE'] must be an alias of "
                    f"settings.DATABASES, got {alias!r}.",
                    hint=f"Configured aliases: {', '.join(sorted(aliases))}.",
                    id="jobs.E040",
                )
            )
    listed = user.get("DATABASES")
    if listed is None:
        return errors
    if (
        isinstance(listed, str)
        or not isinstance(listed, list | tuple)
        or not listed
        or not all(isinstance(alias, str) for alias in listed)
    ):
        return [
            *errors,
            Error(
                f"JOBS['DATABASES'] must be a non-empty list of database aliases, got {listed!r}.",
                hint="Leave it out to cover JOBS['DATABASE'] and the aliases job types name.",
                id="jobs.E041",
            ),
        ]
    unknown = [alias for alias in listed if alias not in aliases]
    if unknown:
        errors.append(
            Error(
                f"JOBS['DATABASES'] names aliases that settings.DATABASES does not have: "
                f"{', '.join(map(repr, unknown))}.",
                id="jobs.E041",
            )
        )
    if not isinstance(database, str):  # jobs.E040: what it would need listed is unknown
        return errors
    needed = [database, *_bound_aliases(), *_task_aliases(database)]
    missing = [alias for alias in _unique(needed) if alias not in listed]
    if missing:
        errors.append(
            Error(
                f"JOBS['DATABASES'] leaves out aliases that hold jobs: "
                f"{', '.join(map(repr, missing))}.",
                hint="List JOBS['DATABASE'], every alias a job type names (database=) and "
                "every task backend's DATABASE, or leave JOBS['DATABASES'] out.",
                id="jobs.E041",
            )
        )
    return errors


def _bound_aliases() -> list[str]:
    if not catalogue.frozen:
        return []
    return [t.policy.database for t in catalogue.get() if t.policy.database is not None]


def _task_aliases(default: str | None = None) -> list[str]:
    """The ``DATABASE`` option of each task backend of this app (``TASKS``)."""
    found = []
    for options in (getattr(settings, "TASKS", None) or {}).values():
        if isinstance(options, dict) and options.get("BACKEND") == TASK_BACKEND:
            alias = (options.get("OPTIONS") or {}).get("DATABASE") or default or home()
            if isinstance(alias, str):
                found.append(alias)
    return found


def _unique(aliases: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(aliases))
