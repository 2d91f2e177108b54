"""Operator actions across run tables, below the UI: the admin and the commands both call these.

::

    jobs.admin, jobs.admin (views, forms, templates)    manage.py replay, …
                         │                                     │
                         └──────────────▶ jobs.control ◀───────┘
                                             │
                   jobs.queue (the jobs tables)   Model.replay (each domain's table)
                                             │
                                  jobs.models, jobs.runs

* :mod:`~jobs.control.tables`: every run table as operators see it (filters, columns,
  permissions, replay dispatch);
* :mod:`~jobs.control.failures`: rows of every table merged into one page, failures grouped;
* :mod:`~jobs.control.replays`: replay across tables, checked, bounded and recorded;
* :mod:`~jobs.control.links`: a job and the run row it drives, found from either side.

Each action is one function here taking the operator (``request.user`` or a command's user);
new actions (cancel, pause) belong beside :func:`replay`.
"""

from jobs.control.failures import MAX_ROWS, Page, eligible_rows, failure_groups, fetch_page
from jobs.control.links import Link, link_of, links_for
from jobs.control.replays import (
    REPLAY_ALL_LIMIT,
    Replayed,
    check_permission,
    denial,
    parse_tokens,
    replay,
    summary,
)
from jobs.control.tables import AGES, Filters, Operator, Row, RunTable, run_tables, visible_tables

__all__ = [
    "AGES",
    "MAX_ROWS",
    "REPLAY_ALL_LIMIT",
    "Filters",
    "Link",
    "Operator",
    "Page",
    "Replayed",
    "Row",
    "RunTable",
    "check_permission",
    "denial",
    "eligible_rows",
    "failure_groups",
    "fetch_page",
    "link_of",
    "links_for",
    "parse_tokens",
    "replay",
    "run_tables",
    "summary",
    "visible_tables",
]
