"""A JSON log formatter that keeps the structured fields ``jobs`` attaches to its records.

Worker and scheduler log records carry ``extra`` fields (``action``, ``job_id``,
``job_type``, ``tenant``, ``attempt``, ``outcome``, ``code``, ``duration``…). Any JSON
formatter picks them up; this one needs no extra dependency::

    LOGGING = {
        "version": 1,
        "formatters": {"json": {"()": "jobs.logging.JsonFormatter"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["console"], "level": "INFO"},
    }
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the record's extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
