"""Review round 11: what a user's type checker says about ``concurrency=None``."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_concurrency_none_passes_mypy(monkeypatch):
    monkeypatch.chdir(ROOT)
    module = Path("tests") / "typing" / "review_round11_concurrency.py"
    stdout, stderr, status = mypy_api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), str(module)]
    )
    assert not stderr, stderr
    assert status == 0, stdout
