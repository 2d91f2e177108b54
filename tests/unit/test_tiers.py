"""The heavy and alone tiers name tests that exist: a renamed test must not leave its tier."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.tiers import ALONE, HEAVY

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_a_tier_names_exists():
    defined = {
        name
        for path in TESTS.rglob("test_*.py")
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M)
    }
    assert sorted((HEAVY | ALONE) - defined) == []
