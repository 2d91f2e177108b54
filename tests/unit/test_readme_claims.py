"""The README says which test or benchmark checks each of its claims; those must exist.

A reference is a backticked ``tests/….py::Class::test_name`` (or ``tests/….py::test_name``, or
just a file) or a ``bench/….py`` path, also inside a command such as
``.venv/bin/python bench/drain.py --type touch``. Every one named in README.md and docs/*.md
must point at a file that exists and, with ``::``, at a test pytest collects there (read with
``ast``, nothing imported; parametrize ids such as ``[after]`` are ignored). A renamed or deleted
test then fails this check instead of leaving the README pointing at nothing. No database.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

#: The README must name at least this many checks, so that the check cannot pass on nothing.
MIN_README_REFERENCES = 20

_FENCED_BLOCK = re.compile(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_REFERENCE = re.compile(r"(?<![\w./-])((?:tests|bench)/[\w./-]+?\.py)(?:::(\S+))?(?![\w.-])")
_PARAMETRIZE_ID = re.compile(r"\[.*\]$")


@dataclass(frozen=True)
class Reference:
    """A file under tests/ or bench/, and the test inside it if ``::`` named one."""

    path: str
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return "::".join((self.path, *self.names))


def references(text: str) -> list[Reference]:
    """Every reference in the backticked spans of a Markdown text, once each, in order."""
    text = _FENCED_BLOCK.sub("", text)
    found: dict[Reference, None] = {}
    for span in _CODE_SPAN.finditer(text):
        for match in _REFERENCE.finditer(span.group(1)):
            path, node = match.group(1), match.group(2)
            names = tuple(_PARAMETRIZE_ID.sub("", node).split("::")) if node else ()
            found.setdefault(Reference(path, names), None)
    return list(found)


def references_in(*paths: Path) -> list[Reference]:
    """The references of these Markdown files together, once each."""
    found: dict[Reference, None] = {}
    for path in paths:
        for reference in references(path.read_text(encoding="utf-8")):
            found.setdefault(reference, None)
    return list(found)


def missing(refs: list[Reference], root: Path = ROOT) -> list[str]:
    """What is wrong with each reference that does not name an existing file or test."""
    problems = []
    modules: dict[str, ast.Module] = {}
    for ref in refs:
        file = root / ref.path
        if not file.is_file():
            problems.append(f"{ref}: no file {ref.path}")
            continue
        if not ref.names:
            continue
        if not all(ref.names) or any(not name.isidentifier() for name in ref.names):
            problems.append(f"{ref}: not a test name")
            continue
        *classes, last = ref.names
        if any(not name.startswith("Test") for name in classes) or not last.startswith(
            ("test", "Test")
        ):
            problems.append(
                f"{ref}: pytest does not collect it (classes are Test*, functions test*)"
            )
            continue
        if ref.path not in modules:
            modules[ref.path] = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        module = modules[ref.path]
        if not _defines(module.body, ref.names, _classes(module)):
            problems.append(f"{ref}: no {'::'.join(ref.names)} in {ref.path}")
    return problems


def _classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


def _defines(
    body: list[ast.stmt],
    names: tuple[str, ...],
    classes: dict[str, ast.ClassDef],
    seen: frozenset[str] = frozenset(),
) -> bool:
    """Whether ``names`` (classes, then a function or class) is defined in ``body``.

    A test class also has the tests of its base classes defined in the same module.
    """
    name, rest = names[0], names[1:]
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            if not rest:
                return True
        elif isinstance(node, ast.ClassDef) and node.name == name:
            if not rest or _defines(node.body, rest, classes, seen):
                return True
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                    inherited = classes[base.id].body
                    if _defines(inherited, rest, classes, seen | {base.id}):
                        return True
    return False


# The helpers, on texts and trees made here -------------------------------------------------

SAMPLE = """\
A claim (`tests/integration/test_worker.py::TestOutcomeTable::test_ok[validate-fails]`), another
(`tests/unit/test_types.py::test_final_attempt_flag`), a file (`tests/acceptance/test_browser.py`),
a benchmark `.venv/bin/python bench/drain.py --type touch --processes 2` and
`bench/enqueue.py`, the same test again `tests/unit/test_types.py::test_final_attempt_flag`.

Not references: tests/unit/test_types.py::test_outside_backticks, `tests/`, `bench/README.md`,
`tests/artifacts/monitor.png`, `mytests/x.py::test_a`, `tests/x.pyc`.

```sh
pytest `tests/unit/test_in_a_fenced_block.py::test_x`
```
"""


def test_references_reads_backticked_tests_and_benchmarks_once_each():
    assert [str(ref) for ref in references(SAMPLE)] == [
        "tests/integration/test_worker.py::TestOutcomeTable::test_ok",
        "tests/unit/test_types.py::test_final_attempt_flag",
        "tests/acceptance/test_browser.py",
        "bench/drain.py",
        "bench/enqueue.py",
    ]
    assert references(SAMPLE)[0] == Reference(
        "tests/integration/test_worker.py", ("TestOutcomeTable", "test_ok")
    )
    assert references("no references at all") == []


def test_references_in_reads_files_together(tmp_path):
    readme, doc = tmp_path / "README.md", tmp_path / "guide.md"
    readme.write_text("`tests/unit/test_a.py::test_one` and `bench/b.py`\n")
    doc.write_text("`bench/b.py` again, and `tests/unit/test_a.py::TestX::test_two`\n")

    assert [str(ref) for ref in references_in(readme, doc)] == [
        "tests/unit/test_a.py::test_one",
        "bench/b.py",
        "tests/unit/test_a.py::TestX::test_two",
    ]


def test_missing_names_every_reference_that_points_at_nothing(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "drain.py").write_text("print('drained')\n")
    (tmp_path / "tests" / "unit" / "test_a.py").write_text(
        "import pytest\n\n"
        "def helper():\n    pass\n\n"
        "def test_kept():\n    pass\n\n"
        "async def test_async():\n    pass\n\n"
        "class Base:\n    def test_inherited(self):\n        pass\n\n"
        "class TestGroup(Base):\n"
        "    @pytest.mark.parametrize('n', [1, 2])\n"
        "    def test_member(self, n):\n        pass\n\n"
        "    class TestInner:\n        def test_deep(self):\n            pass\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "Checked by `tests/unit/test_a.py::test_kept`, `tests/unit/test_a.py::test_async`,\n"
        "`tests/unit/test_a.py::TestGroup::test_member[2]`, `tests/unit/test_a.py::TestGroup`,\n"
        "`tests/unit/test_a.py::TestGroup::test_inherited`,\n"
        "`tests/unit/test_a.py::TestGroup::TestInner::test_deep`, `tests/unit/test_a.py` and\n"
        "`.venv/bin/python bench/drain.py --processes 2`. Stale: `bench/gone.py`,\n"
        "`tests/unit/test_gone.py::test_x`, `tests/unit/test_a.py::test_renamed`,\n"
        "`tests/unit/test_a.py::TestGroup::test_kept`, `tests/unit/test_a.py::helper`,\n"
        "`tests/unit/test_a.py::TestMissing::test_member`.\n"
    )

    assert missing(references_in(readme), root=tmp_path) == [
        "bench/gone.py: no file bench/gone.py",
        "tests/unit/test_gone.py::test_x: no file tests/unit/test_gone.py",
        "tests/unit/test_a.py::test_renamed: no test_renamed in tests/unit/test_a.py",
        "tests/unit/test_a.py::TestGroup::test_kept: no TestGroup::test_kept in "
        "tests/unit/test_a.py",
        "tests/unit/test_a.py::helper: pytest does not collect it (classes are Test*, "
        "functions test*)",
        "tests/unit/test_a.py::TestMissing::test_member: no TestMissing::test_member in "
        "tests/unit/test_a.py",
    ]


def test_missing_finds_the_tests_of_this_repository():
    here = "tests/unit/test_readme_claims.py"
    text = (
        f"`{here}::test_missing_finds_the_tests_of_this_repository` and "
        f"`{here}::test_no_such_test`, `bench/drain.py`"
    )
    assert missing(references(text)) == [
        f"{here}::test_no_such_test: no test_no_such_test in {here}"
    ]


# The real README and docs -------------------------------------------------------------------


def test_every_test_and_benchmark_the_docs_name_exists():
    documents = [README, *DOCS]
    assert missing(references_in(*documents)) == [], "README.md or docs/ name what is not there"


def test_the_readme_names_the_checks_of_its_claims():
    named = references_in(README)
    assert len(named) >= MIN_README_REFERENCES, (
        f"README.md names {len(named)} tests or benchmarks (at least {MIN_README_REFERENCES} "
        f"expected, as `tests/….py::test_name` or `bench/….py`): {[str(r) for r in named]}"
    )
