"""The app's layers import downwards only, and no module of the app takes part in an import cycle.

The layer order is the contract in ``pyproject.toml`` (``[tool.importlinter]``), read by
import-linter from every import statement, those inside functions and under
``TYPE_CHECKING`` included, so a wrong-way import fails here before it can hide behind a
lazy import at run time. docs/architecture.md says what each layer is for.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
# Parts of the package that no layer holds: the app's config, the app's own job types (read
# like any app's jobs.py) and the migrations (frozen history, never imported by the code).
OUTSIDE_THE_LAYERS = {"jobs.apps", "jobs.jobs", "jobs.migrations"}


def contract() -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = (c for c in config["contracts"] if c["type"] == "layers")
    return layers


# In a process of its own: import-linter disables the loggers that exist when it runs.
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def test_every_import_follows_the_layer_order():
    linted = subprocess.run(
        [sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_every_part_of_the_app_has_a_layer():
    """A new top-level module or package must be given its place in the order."""
    named = {
        part.strip()
        for layer in contract()["layers"]  # type: ignore[attr-defined]
        for part in layer.replace(":", "|").split("|")
    }
    parts = {
        f"jobs.{path.stem if path.is_file() else path.name}"
        for path in JOBS.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__")
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert parts - OUTSIDE_THE_LAYERS - named == set()
    assert named - parts == set()


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def import_edges(modules: Iterable[str], graph: grimp.ImportGraph) -> dict[str, set[str]]:
    modules = set(modules)
    return {module: graph.find_modules_directly_imported_by(module) & modules for module in modules}


def test_no_module_of_the_app_is_part_of_an_import_cycle():
    graph = grimp.build_graph("jobs")
    modules = {m for m in graph.modules if not m.startswith("jobs.migrations")}
    assert cycles(import_edges(modules, graph)) == []


def test_the_cycle_check_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
