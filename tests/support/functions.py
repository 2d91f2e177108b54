"""The PL/pgSQL functions as the migrations install them and as the database holds them."""

from __future__ import annotations

import importlib

from django.db import connection

PASS_FUNCTIONS = ("jobs_worker_pass", "jobs_worker_fair_pass")


def migration_sql(module: str) -> str:
    return importlib.import_module(f"jobs.migrations.{module}").SQL


def function_body(sql: str) -> str:
    return sql.split("$$")[1]


def installed_sources() -> dict[str, str]:
    """The pass functions' texts, as installed."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT proname, prosrc FROM pg_proc WHERE proname = ANY(%s)", [list(PASS_FUNCTIONS)]
        )
        return dict(cur.fetchall())
