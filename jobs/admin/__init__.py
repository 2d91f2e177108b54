"""The console: the jobs admin, the failure monitor, and the operator's pages.

:mod:`jobs.admin.jobs` registers the jobs tables with the default admin site and mounts the
console's pages under the jobs list's URLs; the other modules are those pages (overview,
monitor, performance, flow, schedules, pauses, processes, batches) and what they share.

The pages only show and ask: what they read comes from :mod:`jobs.queue` and what they do
from :mod:`jobs.control`, which ``manage.py replay`` and ``manage.py jobs`` call too. The
failure monitor reads each run table with its own bounded, index-friendly queries and merges
the results in Python, newest first::

    jobs_job       ── count (capped) + SELECT … ORDER BY t DESC LIMIT end ──┐
    mail_delivery  ── count (capped) + SELECT … ORDER BY t DESC LIMIT end ──┼─ heapq.merge ─▶ page
    …every concrete RunContract table found through the app registry     ──┘

Replay is dispatched to each row's own table, so "redo the work" keeps its domain meaning;
see :mod:`jobs.control.replays`.
"""

from jobs.admin.jobs import RunTableAdmin as RunTableAdmin  # apps subclass it from here
