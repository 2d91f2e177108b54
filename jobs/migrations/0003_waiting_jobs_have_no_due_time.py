"""A job that waits for others has no ``run_after`` (NULL) instead of a far-future date.

Existing waiting rows, and history rows that ended while waiting, lose the old placeholder
date (the first of January 9000). Both updates read the whole table once; waiting rows are
few, so they write little. Reversed, the placeholder comes back before NOT NULL does.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

PLACEHOLDER = "'9000-01-01 00:00:00+00'::timestamptz"


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_functions"),
    ]

    operations = [
        migrations.AlterField(
            model_name="job",
            name="run_after",
            field=models.DateTimeField(
                db_default=django.db.models.functions.datetime.Now(),
                help_text=(
                    "Earliest time the job may run; a scheduled retry moves it forward. Empty "
                    "while the job waits for others: it becomes due when the last of them has "
                    "succeeded."
                ),
                null=True,
                verbose_name="run after",
            ),
        ),
        migrations.AlterField(
            model_name="jobhistory",
            name="run_after",
            field=models.DateTimeField(null=True, verbose_name="run after"),
        ),
        migrations.RunSQL(
            sql=[
                (
                    "UPDATE jobs_job SET run_after = NULL"
                    f" WHERE run_after = {PLACEHOLDER} AND waiting_on > 0"
                ),
                f"UPDATE jobs_jobhistory SET run_after = NULL WHERE run_after = {PLACEHOLDER}",
            ],
            reverse_sql=[
                f"UPDATE jobs_job SET run_after = {PLACEHOLDER} WHERE run_after IS NULL",
                f"UPDATE jobs_jobhistory SET run_after = {PLACEHOLDER} WHERE run_after IS NULL",
            ],
        ),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("run_after__isnull", False), ("waiting_on__gt", 0), _connector="OR"
                ),
                name="jobs_job_due_or_waiting",
            ),
        ),
    ]
