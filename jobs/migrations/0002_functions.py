"""The database functions and triggers, installed from jobs/queue/sql/functions/.

Each file is read when the migration runs; the digests say which text this migration was
written for (jobs/migrations/_functions.py says why, and what a change to a file needs).
"""

from django.db import migrations

from jobs.migrations._functions import InstallFunctions


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0001_initial"),
    ]

    operations = [
        InstallFunctions(
            {
                "jobs_histogram_of": "f87c1da5d80c5d26",
                "jobs_histogram_add": "776b4a3517048c9d",
                "jobs_rollup_add": "b64b96c17bfaa6df",
                "jobs_enqueue_job": "6982bc668fa1903c",
                "jobs_fair_pick_v2": "307af8bdf6d5ddf8",
                "jobs_worker_pass_v2": "1ad4cf1cd395ed2b",
                "jobs_worker_fair_pass_v2": "7d68cd9d31e5eba0",
                "jobs_batch_settle": "66d568a1cb1cbd8a",
                "jobs_batch_fire": "e1e5757f2d8f466e",
                "jobs_dependents_release": "085db5908fa21299",
                "jobs_job_settled": "7f29b77910e71575",
                "jobs_dependency_checked": "880c0306a0e3a44e",
            }
        ),
    ]
