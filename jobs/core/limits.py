"""What a stored value may be: the syntax of short identifiers and the bounds of the columns.

Plain values and checks, no models: the catalogue validates a policy or a schedule with them
while the app registry is still loading, and the models and the queue hold rows to the same.
"""

from __future__ import annotations

import re

PRIORITY_MIN, PRIORITY_MAX = -100, 100  # Django's task priority range; higher runs first.
MAX_ATTEMPTS_MAX = 2_147_483_647  # the column is a PostgreSQL integer

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def validate_key(value: object, what: str) -> str:
    """Tenants, components and queues are short identifiers: letters, digits, ``_.:-``."""
    if not isinstance(value, str) or not _KEY.fullmatch(value):
        raise ValueError(
            f"{what} must be 1-64 characters of letters, digits, '_', '.', ':' or '-' "
            f"starting with a letter or digit, got {value!r}"
        )
    return value
