"""How far ahead the history is ready: one row per terminal state, ``until`` a time.

The worker's pass may write a row it ends straight into the history only where a partition
waits for it; the scheduler's archive duty fills this table (``jobs.queue.history``). It starts
empty, which means "not ready": finished rows wait in the jobs table for the archive pass, as
before, until the scheduler's first pass after the migration.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_waiting_jobs_have_no_due_time"),
    ]

    operations = [
        migrations.CreateModel(
            name="HistoryReady",
            fields=[
                (
                    "state",
                    models.CharField(
                        max_length=16, primary_key=True, serialize=False, verbose_name="state"
                    ),
                ),
                ("until", models.DateTimeField(verbose_name="ready until")),
            ],
            options={
                "verbose_name": "history readiness",
                "verbose_name_plural": "history readiness",
                "db_table": "jobs_historyready",
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("state__in", ("succeeded", "failed", "cancelled"))),
                        name="jobs_historyready_terminal",
                    )
                ],
            },
        ),
    ]
