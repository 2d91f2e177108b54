"""The types a user's type checker sees: mypy on typed user code, and the declarations behind it.

mypy runs in this process with the project's configuration (pyproject.toml), on the modules
under tests/typing, which are never imported.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
from mypy import api as mypy_api

import jobs
from jobs.catalogue.policy import Policy, PolicyOptions
from jobs.core.conf import DEFAULTS, JobsSettings

ROOT = Path(__file__).resolve().parents[2]
TYPING = ROOT / "tests" / "typing"
ERROR = re.compile(r"^(?P<path>.+?):(?P<line>\d+): error: (?P<message>.*?)  \[(?P<code>[a-z-]+)\]$")
EXPECTED = re.compile(r"# E: (?P<code>[a-z-]+) ?(?P<text>.*)$")


def run_mypy(module: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    """mypy's report and exit status for one module, as ``mypy <module>`` in the repository."""
    monkeypatch.chdir(ROOT)  # the configuration's paths and mypy's cache are the repository's
    stdout, stderr, status = mypy_api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), str(module.relative_to(ROOT))]
    )
    assert not stderr, stderr
    return stdout, status


@pytest.mark.slow
def test_typed_user_code_passes_mypy(monkeypatch):
    """Every assert_type in the user module holds, and nothing in it is an error."""
    report, status = run_mypy(TYPING / "user_module.py", monkeypatch)
    assert status == 0, report
    assert "Success: no issues found in 1 source file" in report
    # reveal_type shows the decorated handler as the user wrote it, typed by its payload.
    assert (
        'Revealed type is "def (tests.typing.user_module.ResizeImageV1, '
        'jobs.core.context.JobContext) -> Any"' in report
    )


@pytest.mark.slow
def test_wrong_uses_are_refused_where_marked(monkeypatch):
    """Each line marked ``# E: <code> [text]`` in misuse.py has that error, and only those do."""
    module = TYPING / "misuse.py"
    expected: dict[int, tuple[str, str]] = {}
    for number, line in enumerate(module.read_text().splitlines(), start=1):
        if match := EXPECTED.search(line):
            expected[number] = (match["code"], match["text"])
    assert len(expected) >= 10  # the markers were read

    report, status = run_mypy(module, monkeypatch)
    assert status == 1, report
    found: dict[int, tuple[str, str]] = {}
    for line in report.splitlines():
        if match := ERROR.match(line):
            assert Path(match["path"]) == module.relative_to(ROOT), line
            found[int(match["line"])] = (match["code"], match["message"])

    assert sorted(found) == sorted(expected), report
    for number, (code, text) in expected.items():
        found_code, message = found[number]
        assert (found_code, text in message) == (code, True), f"line {number}: {message}"


def test_the_package_ships_its_types():
    """PEP 561: without py.typed in the wheel, a user's checker ignores every annotation."""
    assert (Path(jobs.__file__).parent / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["jobs"]


def test_policy_options_name_every_policy_field():
    """job(), register() and Policy() are typed by PolicyOptions: a new field goes in both."""
    assert set(PolicyOptions.__annotations__) == {f.name for f in dataclasses.fields(Policy)}


def test_jobs_settings_annotate_every_setting():
    """Each JOBS setting has a declared type, and nothing else is declared."""
    assert set(JobsSettings.__annotations__) == set(DEFAULTS)


@pytest.mark.slow
def test_concurrency_none_passes_mypy(monkeypatch):
    monkeypatch.chdir(ROOT)
    module = Path("tests") / "typing" / "concurrency_none.py"
    stdout, stderr, status = mypy_api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), str(module)]
    )
    assert not stderr, stderr
    assert status == 0, stdout
