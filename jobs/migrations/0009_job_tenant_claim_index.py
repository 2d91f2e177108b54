from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Built concurrently: on a large jobs table a plain CREATE INDEX would block enqueues and
    # claims for as long as it reads the table. It starts empty (no row is in tenant order).
    atomic = False

    dependencies = [
        ("jobs", "0008_flow_control"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                models.F("name"),
                models.F("tenant"),
                models.OrderBy(models.F("priority"), descending=True),
                models.F("run_after"),
                models.F("id"),
                condition=models.Q(("fair", True), ("state", "queued")),
                name="jobs_job_tenant_claim",
            ),
        ),
    ]
