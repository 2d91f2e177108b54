"""Real ``runscheduler`` processes: the command line, their metrics and the slots they fired."""

from __future__ import annotations

import re
import urllib.request
from datetime import timedelta

from jobs.models import Job, ScheduleSlot

SCHEDULER = [
    "runscheduler",
    "--settings",
    "tests.runapp.settings_scheduler",
    "--tick-interval",
    "0.1",
    "--standby-interval",
    "0.1",
    "--http-port",
    "0",
]

LEADS = "is now the leader"


def fired_by(process) -> int:
    return ScheduleSlot.objects.filter(recorded_by__contains=f":{process.pid}:").count()


def port(process) -> int:
    return int(process.wait_for_output(r"/metrics on 127\.0\.0\.1:(\d+)").group(1))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def metric(port: int, name: str, labels: str = "") -> float | None:
    body = get(port, "/metrics")[1]
    match = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+-]+)$", body, re.M)
    return float(match.group(1)) if match else None


def assert_each_slot_fired_once_without_gaps(*processes) -> None:
    slots = list(
        ScheduleSlot.objects.filter(schedule="every-second")
        .order_by("slot")
        .values_list("slot", "kind", "job_id", "recorded_by")
    )
    times = [slot for slot, *_ in slots]
    assert times == [times[0] + timedelta(seconds=i) for i in range(len(times))], "a gap"
    assert {kind for _, kind, _, _ in slots} <= {"on_time", "catch_up"}
    job_ids = list(Job.objects.filter(name="jobapp.ping.v1").values_list("job_id", flat=True))
    assert sorted(job_ids) == sorted(job_id for _, _, job_id, _ in slots)
    assert len(set(job_ids)) == len(job_ids)
    assert {by.rsplit(":", 2)[1] for *_, by in slots} == {str(p.pid) for p in processes}
