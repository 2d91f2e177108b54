"""The failure monitor's admin pages: one view over the jobs table and every domain run table.

Only views, forms and templates live here; what they show and do comes from
:mod:`jobs.control`, which ``manage.py replay`` calls too. Each run table stays in its own
home. The monitor reads each one with its own bounded, index-friendly queries and merges the
results in Python, newest first::

    jobs_job       ── count (capped) + SELECT … ORDER BY t DESC LIMIT end ──┐
    mail_delivery  ── count (capped) + SELECT … ORDER BY t DESC LIMIT end ──┼─ heapq.merge ─▶ page
    …every concrete RunContract table found through the app registry     ──┘

Replay is dispatched to each row's own table, so "redo the work" keeps its domain meaning;
see :mod:`jobs.control.replays`.
"""
