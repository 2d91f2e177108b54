from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built concurrently, like 0009: no enqueue or claim waits while it reads the table. It
    # starts empty (no job is in a batch yet).
    atomic = False

    dependencies = [
        ("jobs", "0010_workflows"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("batch__isnull", False)),
                fields=["batch"],
                name="jobs_job_batch",
            ),
        ),
    ]
