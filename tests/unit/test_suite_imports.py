"""No test module imports another: what tests share lives in tests/support.

A test module that imports another makes pytest's collection of one depend on the other, runs
the other's module-level code twice under two names when both are collected, and hides a
shared helper where no one looks for it. Read from the source (lazy imports inside functions
included), no database.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(name: str) -> bool:
    """Whether the dotted ``name`` is a test module or a conftest of this suite."""
    parts = name.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imported_test_modules(source: str) -> list[str]:
    """The test modules and conftests a module's source imports, in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if is_test_module(node.module):
                found.append(node.module)
            else:
                names = (f"{node.module}.{alias.name}" for alias in node.names)
                found += [name for name in names if is_test_module(name)]
    return found


def test_no_module_of_the_suite_imports_a_test_module():
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 100, "the check found too few modules to mean anything"
    problems = {
        str(path.relative_to(TESTS.parent)): found
        for path in files
        if (found := imported_test_modules(path.read_text()))
    }
    assert problems == {}


def test_the_check_reads_every_form_of_import():
    source = (
        "from tests.integration.test_claim import claim_all\n"
        "from tests.integration import test_replay\n"
        "import tests.acceptance.conftest\n"
        "def f():\n"
        "    from tests.unit.test_payloads import draw\n"
        "from tests.support.polling import wait_for\n"
        "from jobs.queue import claim\n"
    )
    assert imported_test_modules(source) == [
        "tests.integration.test_claim",
        "tests.integration.test_replay",
        "tests.acceptance.conftest",
        "tests.unit.test_payloads",
    ]
