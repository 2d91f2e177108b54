"""Reading plans in tests: auto_explain's plans of statements run inside functions (the
pass, the pick) with actual rows and buffers, and the nodes that read the jobs table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction


@contextmanager
def explained_nested_statements() -> Iterator[list[dict]]:
    """The plans, with actual counts, of the statements run inside functions meanwhile.

    Inside a transaction the caller rolls back, which undoes the settings (not the LOAD,
    harmless with them off)."""
    assert connection.in_atomic_block
    plans: list[dict] = []
    raw = connection.connection

    def notice(diagnostic) -> None:
        text = diagnostic.message_primary or ""
        if "Plan" in text and "{" in text:
            plans.append(json.loads(text[text.index("{") :]))

    with connection.cursor() as cur:
        cur.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
            " SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on;"
            " SET auto_explain.log_nested_statements = on;"
            " SET auto_explain.log_format = json; SET auto_explain.log_level = notice"
        )
    raw.add_notice_handler(notice)
    try:
        yield plans
    finally:
        raw.remove_notice_handler(notice)


def plan_nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", ()):
        yield from plan_nodes(child)


def explained_claim(claim) -> tuple[list, list[dict]]:
    """What ``claim()`` returns and the plans auto_explain reports for it, nested ones (the
    pick function's) included, with actual rows and buffers; the transaction is rolled back."""
    plans: list[dict] = []

    def noticed(diagnostic) -> None:
        text = diagnostic.message_primary or ""
        if "plan:" in text:
            plans.append(json.loads(text.split("plan:", 1)[1])["Plan"])

    connection.ensure_connection()
    raw = connection.connection
    raw.add_notice_handler(noticed)
    try:
        with transaction.atomic(), connection.cursor() as cur:
            for setting in (
                "LOAD 'auto_explain'",
                "SET LOCAL auto_explain.log_min_duration = 0",
                "SET LOCAL auto_explain.log_analyze = on",
                "SET LOCAL auto_explain.log_buffers = on",
                "SET LOCAL auto_explain.log_nested_statements = on",
                "SET LOCAL auto_explain.log_format = 'json'",
                "SET LOCAL client_min_messages = 'log'",
            ):
                cur.execute(setting)
            claimed = claim()
            transaction.set_rollback(True)
    finally:
        raw.remove_notice_handler(noticed)
    return claimed, [node for plan in plans for node in plan_nodes(plan)]


def jobs_table_scans(node: dict) -> list[dict]:
    """Every node of ``node``'s plan that reads the jobs table."""
    own = [node] if node.get("Relation Name") == "jobs_job" else []
    return own + [scan for child in node.get("Plans", []) for scan in jobs_table_scans(child)]
