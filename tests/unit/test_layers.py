"""The layers import downwards only: models below the queue, operator actions below the admin.

Read from the source (the import statements, lazy ones inside functions included), so a
forbidden import fails here before it can hide behind an import cycle at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"

ADMIN = ("jobs.monitor", "jobs.admin")
# What each layer must not import, by the files that make it up.
RULES: dict[str, tuple[str, ...]] = {
    "models.py": ("jobs.queue", "jobs.control", "jobs.worker", *ADMIN),
    "runs.py": ("jobs.queue", "jobs.control", "jobs.worker", *ADMIN),
    "control/*.py": ADMIN,
    "management/commands/*.py": ADMIN,
}


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, spelled in full (``from jobs import queue`` included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def forbidden(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(
        name
        for name in imported(path)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)
    )


@pytest.mark.parametrize("pattern", sorted(RULES))
def test_each_layer_imports_nothing_above_it(pattern):
    files = sorted(JOBS.glob(pattern))
    assert files, f"no files match jobs/{pattern}"
    problems = {
        str(path.relative_to(JOBS)): found
        for path in files
        if (found := forbidden(path, RULES[pattern]))
    }
    assert problems == {}


def test_the_check_reads_lazy_and_from_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from jobs import queue\n    import jobs.admin\n")
    assert forbidden(module, ("jobs.queue", "jobs.admin")) == ["jobs.admin", "jobs.queue"]
