"""The effect journal (jobs.effects): one row per (job, step) that calls the outside world."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0011_job_batch_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="Effect",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "job", "step", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("job", models.BigIntegerField(verbose_name="job")),
                ("step", models.CharField(max_length=200, verbose_name="step")),
                ("key", models.CharField(max_length=64, verbose_name="effect key")),
                (
                    "state",
                    models.CharField(
                        choices=[("intent", "intent recorded"), ("done", "done")],
                        max_length=8,
                        verbose_name="state",
                    ),
                ),
                ("result", models.JSONField(blank=True, null=True, verbose_name="result")),
                ("attempt", models.PositiveIntegerField(verbose_name="attempt")),
                (
                    "started_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(),
                        verbose_name="intent recorded at",
                    ),
                ),
                (
                    "finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="done at"),
                ),
            ],
            options={
                "verbose_name": "effect",
                "verbose_name_plural": "effects",
                "indexes": [models.Index(fields=["started_at"], name="jobs_effect_started")],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("state__in", ["intent", "done"])),
                        name="jobs_effect_state_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("finished_at__isnull", True), ("state", "intent")),
                            models.Q(("finished_at__isnull", False), ("state", "done")),
                            _connector="OR",
                        ),
                        name="jobs_effect_done_has_finished_at",
                    ),
                ],
            },
        ),
    ]
