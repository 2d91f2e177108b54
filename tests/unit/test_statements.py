"""The queue's statements and database functions in jobs/queue/sql/ are the code's.

The statement files and the functions Python builds are rendered from the code
(jobs/queue/statements.py, scripts/render-sql); the other functions' files are their source.
tests/integration/test_migrations.py checks that the database runs what the files say.
"""

from __future__ import annotations

import re

from jobs.queue import statements

FUNCTIONS = statements.FOLDER / "functions"


def test_every_rendered_file_is_what_the_code_renders():
    assert statements.stale() == [], "the code changed: run scripts/render-sql"


def test_each_function_file_creates_the_function_it_is_named_after_and_no_other():
    files = sorted(FUNCTIONS.glob("*.sql"))
    assert files
    for path in files:
        created = re.findall(r"^CREATE OR REPLACE FUNCTION (\w+)\(", path.read_text(), re.M)
        assert created == [path.stem], path.name
