"""System checks for what the failure monitor needs from every run table.

* ``jobs.E030`` a run table that replays declares no replay permission, so nobody but a
  superuser could replay it
* ``jobs.E031`` a run table dropped a column the monitor cannot do without
* ``jobs.E032`` two run tables share a monitor label, so a replay token or a module filter
  could name the wrong one
* ``jobs.W030`` a run table does not implement ``replay()``: its rows show, without replay
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core.checks import CheckMessage, Error, Warning

from jobs.control.tables import RunTable, run_tables

REQUIRED_FIELDS = ("job_id", "state", "created_at")


def check_run_tables(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    first: dict[str, RunTable] = {}
    for table in run_tables():
        model = table.model
        taken = first.setdefault(table.label, table)
        if taken is not table:
            messages.append(
                Error(
                    f"{model.__module__}.{model.__name__} and {taken.model.__module__}."
                    f"{taken.model.__name__} share the monitor label {table.label!r}, so "
                    f"the failure monitor could not tell their rows apart.",
                    hint="Give one of them another monitor_label.",
                    obj=model,
                    id="jobs.E032",
                )
            )
        missing = [name for name in REQUIRED_FIELDS if name not in table.fields]
        if missing:
            messages.append(
                Error(
                    f"{table.label} has no {', '.join(missing)} column, which the failure "
                    f"monitor reads from every run table.",
                    hint="Keep these RunContract fields (do not set them to None).",
                    obj=model,
                    id="jobs.E031",
                )
            )
        if not table.supports_replay:
            messages.append(
                Warning(
                    f"{table.label} does not implement replay(); the failure monitor shows "
                    f"its rows but cannot replay them.",
                    hint="Define a replay(cls, pks, *, by) classmethod saying what redo means.",
                    obj=model,
                    id="jobs.W030",
                )
            )
            continue
        app_label, _dot, codename = table.replay_permission.partition(".")
        # A table may share a permission another model of its app declares (finished jobs
        # replay under the jobs table's own ``jobs.replay_job``).
        declared = {
            name
            for other in apps.get_app_config(model._meta.app_label).get_models()
            for name, _label in other._meta.permissions
        }
        if app_label == model._meta.app_label and codename not in declared:
            messages.append(
                Error(
                    f"{table.label} declares no {codename!r} permission, so only superusers "
                    f"could replay its rows.",
                    hint=f'Add Meta.permissions = [("{codename}", "Can replay …")] and a '
                    f"migration, or override replay_permission().",
                    obj=model,
                    id="jobs.E030",
                )
            )
    return messages
