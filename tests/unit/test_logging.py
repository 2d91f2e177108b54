"""The JSON formatter keeps the structured fields of job log records."""

from __future__ import annotations

import json
import logging

from jobs.logging import JsonFormatter


def test_json_lines_carry_the_extra_fields():
    record = logging.makeLogRecord(
        {
            "name": "jobs.worker",
            "levelname": "WARNING",
            "msg": "job %s (%s) will retry: %s",
            "args": ("j-1", "mail.send.v1", "handler_error"),
            "job_id": "j-1",
            "job_type": "mail.send.v1",
            "tenant": "acme",
            "attempt": 2,
            "outcome": "retried",
            "duration": 0.25,
        }
    )

    line = json.loads(JsonFormatter().format(record))

    assert line["message"] == "job j-1 (mail.send.v1) will retry: handler_error"
    assert line["level"] == "WARNING" and line["logger"] == "jobs.worker"
    assert {k: line[k] for k in ("job_id", "job_type", "tenant", "attempt", "outcome")} == {
        "job_id": "j-1",
        "job_type": "mail.send.v1",
        "tenant": "acme",
        "attempt": 2,
        "outcome": "retried",
    }
    assert line["duration"] == 0.25
