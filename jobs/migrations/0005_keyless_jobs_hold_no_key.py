"""A keyless job holds no key: only a key the caller chose goes into the key lock.

The check that every active row holds its key now exempts keyless rows. The new constraint
follows from the old one, so it is added ``NOT VALID`` beside it (a moment's lock, no scan),
the old one dropped, and the new one validated in a transaction of its own, which reads the
table while enqueues, claims and outcomes go on (``VALIDATE CONSTRAINT`` takes a SHARE UPDATE
EXCLUSIVE lock only). Rows that hold a generated key keep it until they end. The enqueue,
the pass, the successor's insert and the release of waiting jobs write the new rule, and the
pass moves a keyless job that ends into the history in the statement that ends it, once the
history is ready for it (jobs_historyready).

Going back keeps the new rule under the old name and the functions installed again here as
they are; it drops the new passes, whose predecessors were left as they were.
"""

from django.db import migrations, models

from jobs.migrations._functions import InstallFunctions

NEW = "jobs_job_active_keyed_holds_key"
OLD = "jobs_job_active_holds_key"
NEW_CHECK = """("key_held" OR NOT ("state" IN ('queued', 'running')) OR NOT "keyed")"""


class Migration(migrations.Migration):
    # Each statement commits on its own, so the validation holds no lock that stops writers.
    atomic = False

    dependencies = [
        ("jobs", "0004_history_ready"),
    ]

    operations = [
        migrations.RunSQL(
            sql=[
                f'ALTER TABLE "jobs_job" ADD CONSTRAINT "{NEW}" CHECK {NEW_CHECK} NOT VALID',
                f'ALTER TABLE "jobs_job" DROP CONSTRAINT "{OLD}"',
                f'ALTER TABLE "jobs_job" VALIDATE CONSTRAINT "{NEW}"',
            ],
            # Going back keeps the rule that lets keyless rows go without their key, under
            # the old name: the functions this migration installs stay as they are
            # (InstallFunctions' ``again``), and the old rule would refuse their keyless rows.
            # The previous release's statements all satisfy it.
            reverse_sql=[f'ALTER TABLE "jobs_job" RENAME CONSTRAINT "{NEW}" TO "{OLD}"'],
            state_operations=[
                migrations.RemoveConstraint(model_name="job", name=OLD),
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.CheckConstraint(
                        condition=models.Q(
                            ("key_held", True),
                            models.Q(("state__in", ("queued", "running")), _negated=True),
                            ("keyed", False),
                            _connector="OR",
                        ),
                        name=NEW,
                    ),
                ),
            ],
        ),
        # The pass reads the history's readiness (0004): a function of a new name, so the
        # previous release's workers keep calling theirs, as it was, during a rolling deploy
        # and after going back, when this one is dropped.
        InstallFunctions(
            {
                "jobs_worker_pass_v3": "e7c26fc4dbab3869",
                "jobs_worker_fair_pass_v3": "6f1c6a9e9a0e58b8",
            }
        ),
        InstallFunctions(
            {
                "jobs_enqueue_job": "c211d598a646cd59",
                "jobs_batch_fire": "5b35733393a1f6b8",
                "jobs_dependents_release": "837ee011cb58077d",
            },
            again=True,
        ),
    ]
