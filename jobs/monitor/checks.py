"""System checks for what the failure monitor needs from every run table.

* ``jobs.E030`` a run table that replays declares no replay permission, so nobody but a
  superuser could replay it
* ``jobs.E031`` a run table dropped a column the monitor cannot do without
* ``jobs.W030`` a run table does not implement ``replay()``: its rows show, without replay
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from jobs.monitor.tables import run_tables

REQUIRED_FIELDS = ("job_id", "state", "created_at")


def check_run_tables(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    for table in run_tables():
        model = table.model
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
        declared = {name for name, _label in model._meta.permissions}
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
