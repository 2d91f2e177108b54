"""The migrations' way to install the database functions: from their files.

Each PL/pgSQL function (with the trigger that calls it, where it has one) lives in one file,
``jobs/queue/sql/functions/<name>.sql``, and :class:`InstallFunctions` runs the files.
A migration names each function it installs with a digest of its file as the migration
was written. tests/integration/test_migrations.py fails when the latest migration that names
a file names another digest than the file's: a change to a function's file needs a new
migration that installs it again (``InstallFunctions(["<name>"])`` and its digest), or the
databases already migrated would keep running the old text.

The files are read as they are now, so on a new database an earlier migration installs a
function's latest text, which the later migration then installs again. A function whose
arguments or result change gets a new name (``_v2``, ``_v3``): workers of the previous
release keep calling the old one while a deploy rolls out, and a later migration drops it.
Going back drops the functions a migration installed first (and their triggers), and keeps
those a migration installed again (:class:`InstallFunctions`).

(The module's name starts with ``_``: Django's migration loader passes it by.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from django.db import migrations

#: Where the functions' files are.
FOLDER = Path(__file__).resolve().parent.parent / "queue" / "sql" / "functions"


def text(name: str) -> str:
    """The file of function ``name``."""
    return (FOLDER / f"{name}.sql").read_text()


def digest(name: str) -> str:
    """What a migration names the file of function ``name`` by: the SHA-256 of what it
    installs (the comment lines that open the file left out), shortened."""
    lines = text(name).splitlines(keepends=True)
    while lines and lines[0].startswith("--") or lines and not lines[0].strip():
        lines.pop(0)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]


class InstallFunctions(migrations.RunSQL):
    """Create or replace functions from their files; going back, drop them.

    ``again=True`` marks a migration that installs functions an earlier one installed
    first: going back past it keeps them as they are, since the text it replaced is not
    shipped, and dropping them would leave the earlier migration's schema without them. Such
    a migration keeps the functions' new text working on the schema it goes back to.
    """

    def __init__(self, functions: Mapping[str, str], *, again: bool = False) -> None:
        #: Each function installed, with the digest of its file when the migration was made.
        self.functions = dict(functions)
        super().__init__(
            sql=[text(name) for name in self.functions],
            reverse_sql=(
                migrations.RunSQL.noop
                if again
                else [
                    f"DROP FUNCTION IF EXISTS {name} CASCADE" for name in reversed(self.functions)
                ]
            ),
        )

    def describe(self) -> str:
        return "Install the functions " + ", ".join(self.functions)
