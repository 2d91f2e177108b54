"""Who acts from a command line: the staff user a ``--user`` option names."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model


def staff_user(username: str) -> Any:
    """The active staff user named ``username``; ValueError saying why not otherwise.

    Commands act as a named user so their changes carry the same permissions and log entries
    as the admin's; only staff may use the admin, so only staff may act here.
    """
    model = get_user_model()
    try:
        user = model._default_manager.get_by_natural_key(username)
    except model.DoesNotExist:
        raise ValueError(f"no user {username!r}") from None
    if not user.is_active:
        raise ValueError(f"user {username!r} is not active")
    if not user.is_staff:
        raise ValueError(f"user {username!r} is not staff: only staff may act on jobs")
    return user
